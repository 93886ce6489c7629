"""A checkpoint's identity: a short hash of its files, independent of where the folder lives."""

from __future__ import annotations

import hashlib
from pathlib import Path

from maskkv_cli.paths import resolve_model_path

__all__ = ["folder_fingerprint", "model_fingerprint"]

_FINGERPRINT_BYTES = 1 << 20


def _is_model_note(name: str) -> bool:
    """Files in a model folder that describe the model without taking part in running it."""
    lower = name.lower()
    return lower == "training.json" or lower.endswith(".md") or lower.startswith(("license", "notice"))


def model_fingerprint(path: str | Path) -> str:
    """A short hash that changes when the checkpoint changes: every file's name, size, first and last MiB.

    Cheap for an 8B checkpoint (a file of at most 2 MiB is read whole), and independent of where the
    folder lives, so a copy of the same checkpoint reuses rows. Files that cannot change an answer (the training
    record, read-me and licence files) are left out, so editing a model's notes keeps its finished rows.
    """
    return folder_fingerprint(resolve_model_path(path))


def folder_fingerprint(folder: Path) -> str:
    """``model_fingerprint`` of a folder already resolved (``models.checkpoint.ModelFolder.fingerprint``)."""
    digest = hashlib.sha256()
    for item in sorted(folder.iterdir()):
        if item.name.startswith(".") or not item.is_file() or _is_model_note(item.name):
            continue
        size = item.stat().st_size
        digest.update(f"{item.name}\x00{size}\x00".encode())
        with item.open("rb") as handle:
            digest.update(handle.read(_FINGERPRINT_BYTES))
            if size > 2 * _FINGERPRINT_BYTES:
                handle.seek(size - _FINGERPRINT_BYTES)
            digest.update(handle.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]
