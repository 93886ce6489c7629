"""The documents of a batch, each parsed once through the ingest store, with the ingest command's per-file
rule (``maskkv_cli.documents.ingest``): one bad file never stops the rest, and the store's writes are atomic."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoadedDocument:
    path: str
    sha256: str  # of the file's bytes; "" when the file could not be read
    text: str
    error: str | None = None  # one line, when it could not be read or parsed
    pages: tuple[tuple[int, int, int], ...] = ()  # (number, start, end) of each page in ``text``


def load_documents(paths: Iterable[str], password: str | None = None,
                   on_document: Callable[[LoadedDocument], None] | None = None) -> dict[str, LoadedDocument]:
    """Each distinct path once: its text from the store (parsed and stored on first sight), or its error."""
    from maskkv_cli.documents.ingest import ingest_all
    from maskkv_cli.documents.store import DocumentStore
    from maskkv_cli.documents.tokens import TokenCountWarning

    loaded: dict[str, LoadedDocument] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TokenCountWarning)  # ingest counts tokens; batch does not report them
        # a store that cannot be written (a read-only or full cache) leaves each document read, as ask does
        for outcome in ingest_all(DocumentStore(), [Path(p) for p in dict.fromkeys(paths)], password=password,
                                  must_store=False):
            path = str(outcome.path)
            if outcome.document is not None:
                doc = outcome.document
                loaded[path] = LoadedDocument(path, doc.sha256, doc.text, pages=tuple(doc.page_spans()))
            else:
                message = outcome.error or "could not be read"
                if outcome.path.name not in message:
                    message = f"{path}: {message}"
                loaded[path] = LoadedDocument(path, _sha_or_empty(path), "", message)
            if on_document is not None:
                on_document(loaded[path])
    return loaded


def _sha_or_empty(path: str) -> str:
    """The content hash of a file that failed to parse (its jobs' keys still follow its content)."""
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        return ""
