"""Documents for the server: an upload goes through the ingest path into the document store (the one ``maskkv
ingest`` fills), and a request names documents only by their store id, never by a path on the server."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import unicodedata
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from maskkv_cli.documents import EXTENSIONS, Document
from maskkv_cli.documents.store import DocumentStore, StoreEntry
from maskkv_cli.errors import DocumentError, MaskKVError
from maskkv_cli.server.errors import APIError, bad_request, not_found

__all__ = ["entry_json", "ingest_upload", "list_documents", "resolve_documents", "safe_filename", "upload_field"]

UNSAFE = re.compile(r"[^\w. -]+")  # letters and digits of any script stay (a name of Chinese characters is no "_")
SUPPORTED = ", ".join(EXTENSIONS)


def safe_filename(name: str) -> str:
    """The upload's file name without folders or odd characters (controls, punctuation a shell or a file system
    reads), keeping its letters in any script and its extension (which says its kind)."""
    base = UNSAFE.sub("_", Path(unicodedata.normalize("NFC", name).replace("\\", "/")).name).strip(" .")
    return base[-120:] or "document.txt"


def api_words(message: str) -> str:
    """A document's error in the API's terms: a PDF's password is the upload's form field, not ``--password``."""
    return (message.replace("the value passed with --password", "the form field password")
            .replace("with --password", "as the form field password (curl -F password=...)"))


def created_at(iso: str) -> int:
    try:
        return int(datetime.fromisoformat(iso).timestamp())
    except ValueError:
        return 0


def entry_json(entry: StoreEntry) -> dict[str, Any]:
    return {"id": entry.sha256, "object": "document", "filename": entry.name, "kind": entry.kind,
            "pages": entry.pages, "chars": entry.chars, "created_at": created_at(entry.ingested_at)}


def list_documents(store: DocumentStore) -> dict[str, Any]:
    return {"object": "list", "data": [entry_json(e) for e in store.list()]}


UPLOADED = "<upload>"  # the folder an uploaded document's stored source names (``maskkv ingest --list`` shows it)


def ingest_upload(store: DocumentStore, filename: str, data: bytes, password: str | None) -> dict[str, Any]:
    """Read an uploaded file as ``maskkv ingest`` reads one (same checks, same errors) and store it; the answer
    carries the document's ``id``. Runs in a thread: parsing a PDF takes a while."""
    name = safe_filename(filename)
    suffix = Path(name).suffix.lower()
    if suffix and suffix not in EXTENSIONS:
        raise bad_request(f"{name}: unsupported file type {suffix!r}; upload one of {SUPPORTED} (or a plain-text "
                          "file with no extension)", "file", "unsupported_file")
    folder = Path(tempfile.mkdtemp(prefix="maskkv-upload-"))
    try:
        path = folder / name
        path.write_bytes(data)
        try:
            doc, already = store.ingest(path, password=password, must_store=True)
            if already:  # the entry stays as it is (a file ingested from disk keeps its path): answered by its name
                stored = store.get(doc.sha256)
                doc = stored if stored is not None else doc
            else:  # named by the upload, not by the temporary file it was read from (gone once this returns)
                doc = replace(doc, source=f"{UPLOADED}/{name}")
                store.put(doc)
        except DocumentError as exc:
            raise bad_request(api_words(str(exc)), "file", "unreadable_document") from None
        except OSError as exc:
            raise MaskKVError(f"could not save {name} to the document store in {store.folder} "
                              f"({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"id": doc.sha256, "object": "document", "filename": doc.name, "kind": doc.kind, "pages": len(doc.pages),
            "chars": doc.n_chars, "already_stored": already, "warnings": list(doc.warnings)}


def _read_again(store: DocumentStore, sha: str) -> Document | None:
    """A listed entry that ``get`` cannot give (stored by an older maskkv, in a format this one does not read):
    parsed again from its file when that is still there with the same content, else a 404 that says so (it was a
    plain "no stored document has the id" for an id GET /v1/documents lists). None when no entry has ``sha``."""
    entry = next((e for e in store.list() if e.sha256 == sha), None)
    if entry is None:
        return None
    if os.path.isfile(entry.source):
        try:
            doc, _ = store.ingest(entry.source)
        except MaskKVError:
            doc = None
        if doc is not None and doc.sha256 == sha:
            return doc
    raise not_found(f"the stored document {entry.name} ({entry.short}) was stored by an older maskkv and its file "
                    "is no longer there to read again; upload it again with POST /v1/documents", "maskkv.documents")


def resolve_documents(store: DocumentStore, ids: tuple[str, ...]) -> list[Document]:
    """The stored documents with these ids (a SHA-256, or a prefix of 6+ hex digits that only one has)."""
    docs: list[Document] = []
    stored: list[str] | None = None
    for key in ids:
        sha = key
        if len(key) < 64:
            stored = stored if stored is not None else [e.sha256 for e in store.list()]
            matches = [s for s in stored if s.startswith(key)]
            if len(matches) > 1:
                raise bad_request(f"the id {key!r} is the start of {len(matches)} stored documents' ids; give more of "
                                  "it (GET /v1/documents lists them)", "maskkv.documents")
            sha = matches[0] if matches else ""
        doc = store.get(sha) if sha else None
        if doc is None and sha:
            doc = _read_again(store, sha)
        if doc is None:
            raise not_found(f"no stored document has the id {key!r}; upload it with POST /v1/documents or list the "
                            "ids with GET /v1/documents", "maskkv.documents")
        if all(d.sha256 != doc.sha256 for d in docs):  # two ids of one document (a prefix and the whole): once
            docs.append(doc)
    return docs


def upload_field(form: Any) -> tuple[str, Any]:
    """The form's ``file`` part (an upload), or a 400 saying how to send one."""
    upload = form.get("file")
    if upload is None or isinstance(upload, str) or not hasattr(upload, "read"):
        raise APIError(400, "send the document as a multipart/form-data file field named file, e.g. "
                       "curl -F file=@report.pdf http://127.0.0.1:8000/v1/documents", param="file")
    return upload.filename or "document.txt", upload
