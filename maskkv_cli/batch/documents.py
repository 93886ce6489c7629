"""The documents of a batch, each parsed once through the ingest store; a document that fails is one error.

This is the seam to the ingest command's per-file rule (issue #24): one bad file never stops the rest, and the
store's writes are atomic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoadedDocument:
    path: str
    sha256: str  # of the file's bytes; "" when the file could not be read
    text: str
    error: str | None = None  # one line, when it could not be read or parsed


def load_documents(paths: Iterable[str], password: str | None = None,
                   on_document: Callable[[LoadedDocument], None] | None = None) -> dict[str, LoadedDocument]:
    """Each distinct path once: its text from the store (parsed and stored on first sight), or its error."""
    from maskkv_cli.batch.worker import one_line_error
    from maskkv_cli.store import DocumentStore

    store = DocumentStore()
    loaded: dict[str, LoadedDocument] = {}
    for path in dict.fromkeys(paths):
        try:
            doc, _ = store.ingest(path, password=password)
        except Exception as exc:  # a damaged or missing file fails its own jobs only
            message = one_line_error(exc)
            if Path(path).name not in message:
                message = f"{path}: {message}"
            loaded[path] = LoadedDocument(path, _sha_or_empty(path), "", message)
        else:
            loaded[path] = LoadedDocument(path, doc.sha256, doc.text)
        if on_document is not None:
            on_document(loaded[path])
    return loaded


def _sha_or_empty(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        return ""
