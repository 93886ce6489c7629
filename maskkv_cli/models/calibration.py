"""The per-model calibration profiles: the layer importance MaskKV's boundary-aware layer budgets start from.

``I(l)`` is measured by ``maskkv_cli.engine.importance`` (``maskkv calibrate``). A profile stores it per model as
JSON under ``config_file().parent / "calibration" / "<key>.json"``; the key is the model folder's name plus a
short hash of its ``config.json``, so two models of different configs in folders of the same name never share a
profile. Two checkpoints of one config in folders of one name (two training runs' ``checkpoint``) share a key: the
profile records the fingerprint of the weights it was measured on, and another model's is not used.
This module is the store (what a model's profile is, where it lives, whether it fits the model); whether a run
uses it is the cache plan's decision (``engine.plan.resolve_importance``).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from maskkv_cli.errors import reason
from maskkv_cli.models.checkpoint import ModelFolder, config_hash
from maskkv_cli.models.config import ModelConfig
from maskkv_cli.paths import config_file, resolve_model_path
from maskkv_cli.runtime.fileio import atomic_write_text

__all__ = [
    "CalibrationProfile",
    "find_profile",
    "load_profile",
    "make_profile",
    "model_key",
    "profile_dir",
    "profile_path",
    "save_profile",
]


@dataclass(frozen=True)
class ImportanceResult:
    """A measured layer importance (``engine.importance.measure_importance``), what a profile stores."""

    importance: list[float]  # I(l) per layer, in [0, 2]
    inputs: int  # sequences measured
    tokens: int  # tokens the mean runs over

_FIELDS = ("model", "model_path", "n_layers", "importance", "inputs", "tokens", "created", "maskkv_version")


# ------------------------------------------------------------------------------------------------ profiles


@dataclass(frozen=True)
class CalibrationProfile:
    """A model's calibrated layer importance, as stored on disk."""

    model: str  # the key (see model_key)
    model_path: str
    n_layers: int
    importance: tuple[float, ...]
    inputs: int
    tokens: int
    created: str  # ISO 8601, UTC
    maskkv_version: str
    quantization: str = "none"  # the weights it was measured on (``calibrate --quantize``); absent in older files
    weights: str = ""  # the checkpoint's fingerprint (``ModelFolder.fingerprint``); absent in older files

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["importance"] = list(self.importance)
        if self.quantization == "none":
            del data["quantization"]  # unquantized profiles are written as before the field existed
        if not self.weights:
            del data["weights"]
        return data

    @classmethod
    def from_dict(cls, data: object) -> CalibrationProfile:
        """Validate a parsed profile; raises ``ValueError`` with the reason when it does not fit."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        missing = [f for f in _FIELDS if f not in data]
        if missing:
            raise ValueError(f"missing field(s): {', '.join(missing)}")
        for name in ("n_layers", "inputs", "tokens"):
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"field {name!r} must be a non-negative integer, got {value!r}")
        imp = data["importance"]
        if not isinstance(imp, list) or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in imp):
            raise ValueError("field 'importance' must be a list of numbers")
        if not all(math.isfinite(x) and 0.0 <= x <= 2.0 for x in imp):
            raise ValueError("importance values must be finite numbers in [0, 2]")
        if len(imp) != data["n_layers"]:
            raise ValueError(f"{len(imp)} importance values for n_layers {data['n_layers']}")
        return cls(str(data["model"]), str(data["model_path"]), int(data["n_layers"]),
                   tuple(float(x) for x in imp), int(data["inputs"]), int(data["tokens"]), str(data["created"]),
                   str(data["maskkv_version"]), str(data.get("quantization", "none")), str(data.get("weights", "")))


def _checkpoint(model_path: str | os.PathLike[str] | ModelFolder) -> ModelFolder:
    """``model_path`` as a ``ModelFolder``: a session's comes as it is (nothing resolved or hashed again), a path
    is resolved and its config.json read and hashed here."""
    return ModelFolder.of(model_path)


def _display_name(folder: Path) -> str:
    """The folder's name; for a Hugging Face cache snapshot (a commit hash) the repository's name."""
    name = folder.name
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--"):
        name = repo.removeprefix("models--")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def model_key(model_path: str | os.PathLike[str] | ModelFolder) -> str:
    """``<folder name>-<12 hex digits of sha256 of config.json>`` (``models.checkpoint.config_hash``: the JSON
    re-serialized with sorted keys, so whitespace and key order do not matter; the raw bytes when it is not
    JSON)."""
    if isinstance(model_path, ModelFolder):
        return f"{_display_name(model_path.path)}-{model_path.config_hash}"
    folder = resolve_model_path(model_path)  # a path: only its config.json's bytes are needed, not a config
    return f"{_display_name(folder)}-{config_hash(folder)}"


def profile_dir() -> Path:
    return config_file().parent / "calibration"


def profile_path(model_path: str | os.PathLike[str] | ModelFolder) -> Path:
    return profile_dir() / f"{model_key(model_path)}.json"


def calibrated_layers(cfg: ModelConfig) -> int:
    """How many values a profile of this model holds: one per layer whose prompt cache MaskKV's layer budgets split
    (``ModelConfig.evicted_layers``: DiffusionGemma's full-attention layers, every layer elsewhere)."""
    return len(cfg.evicted_layers)


def make_profile(model_path: str | os.PathLike[str] | ModelFolder, result: ImportanceResult,
                 quantization: str = "none") -> CalibrationProfile:
    """The profile of ``result``, measured on the model's weights as quantized by ``quantization``."""
    from maskkv_cli import __version__

    model = _checkpoint(model_path)
    n_layers = calibrated_layers(model.config)
    if len(result.importance) != n_layers:
        raise ValueError(f"{len(result.importance)} importance values for a model with {n_layers} layers")
    return CalibrationProfile(model_key(model), str(model.path.resolve()), n_layers, tuple(result.importance),
                              result.inputs, result.tokens, datetime.now(UTC).isoformat(timespec="seconds"),
                              __version__, quantization, model.fingerprint)


def save_profile(profile: CalibrationProfile, path: Path | None = None) -> Path:
    """Write ``profile`` (default: under ``profile_dir()`` by its key) atomically: a temp file, then replace."""
    target = path or profile_dir() / f"{profile.model}.json"
    return atomic_write_text(target, json.dumps(profile.to_dict(), indent=2) + "\n")


def find_profile(model_path: str | os.PathLike[str] | ModelFolder) -> tuple[CalibrationProfile | None, str | None]:
    """(the model's profile or None, why a profile file present was ignored or None).

    A missing file gives ``(None, None)``. A file that cannot be read, is not valid JSON, is made for another
    model or does not have one value per layer of this model is ignored with a reason.
    """
    model = _checkpoint(model_path)
    key = model_key(model)
    path = profile_dir() / f"{key}.json"
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return None, f"cannot read it ({reason(exc)})"
    except ValueError as exc:
        return None, f"it is not valid JSON ({exc})"
    try:
        profile = CalibrationProfile.from_dict(data)
    except ValueError as exc:
        return None, str(exc)
    if profile.model != key:
        return None, f"it was made for model {profile.model!r}, not {key!r}"
    n_layers = calibrated_layers(model.config)
    if profile.n_layers != n_layers:
        return None, f"it has {profile.n_layers} layers, the model has {n_layers}"
    if profile.weights and profile.weights != model.fingerprint:
        return None, (f"it was measured on other weights of the same config ({profile.model_path}); calibrate this "
                      "model again")
    return profile, None


def load_profile(model_path: str | os.PathLike[str] | ModelFolder) -> CalibrationProfile | None:
    """The model's calibration profile, or None when there is none or it is unusable (see ``find_profile``)."""
    return find_profile(model_path)[0]
