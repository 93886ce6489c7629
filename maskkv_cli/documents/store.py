"""A small on-disk cache of loaded documents, keyed by the SHA-256 of the file's bytes.

Layout: ``<root>/documents/<sha256>.json``, one JSON object per document (``Document.to_dict`` plus ``format``,
``ingested_at``, ``n_pages`` and ``n_chars``).  Writes are atomic: the JSON goes to a hidden temp file in the same
folder, is fsynced, then renamed over the final name, so a crash mid-write never leaves a partial entry.  Unreadable
entries are skipped, never fatal.

The stored text of a password-protected PDF is kept decrypted (files are created 0600).
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from maskkv_cli.documents import Document, parse_document, read_source
from maskkv_cli.errors import MaskKVError, UsageError
from maskkv_cli.paths import maskkv_home
from maskkv_cli.runtime.fileio import atomic_file

# 2: pages with a damaged text layer are dropped (``textlayer.py``); entries of format 1 are parsed again.
FORMAT_VERSION = 2
MIN_PREFIX = 6
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_HEX_RE = re.compile(r"[0-9a-fA-F]+")
_TEMP_PREFIX = ".tmp-"
_TEMP_SUFFIX = ".part"
_STALE_TEMP_SECONDS = 3600.0
_CHUNK = 1 << 20


def default_root() -> Path:
    """``MASKKV_HOME`` if set, else ``$XDG_CACHE_HOME/maskkv``, else ``~/.cache/maskkv``."""
    return maskkv_home()


@dataclass(frozen=True)
class StoreEntry:
    sha256: str
    source: str
    kind: str
    pages: int
    chars: int
    ingested_at: str  # ISO 8601, UTC
    path: Path

    @property
    def name(self) -> str:
        return Path(self.source).name

    @property
    def short(self) -> str:
        return self.sha256[:12]


def hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_all(fh: BinaryIO, data: bytes) -> None:
    """Write ``data`` in chunks (a seam for tests that interrupt a write)."""
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        fh.write(view[start : start + _CHUNK])


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class DocumentStore:
    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.folder = self.root / "documents"

    def __repr__(self) -> str:
        return f"DocumentStore({str(self.root)!r})"

    # -- paths and raw reads ----------------------------------------------------------------

    def path_for(self, sha256: str) -> Path:
        return self.folder / f"{sha256}.json"

    def _entry_files(self) -> list[Path]:
        try:
            names = os.listdir(self.folder)
        except OSError:  # no store yet (or unreadable): nothing stored
            return []
        return [
            self.folder / name
            for name in sorted(names)
            if name.endswith(".json") and _SHA_RE.fullmatch(name[: -len(".json")])
        ]

    def _read(self, path: Path) -> dict[str, Any] | None:
        """Parse one entry file; None when it is missing, unreadable or malformed."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("sha256") != path.name[: -len(".json")]:
            return None
        return data

    # -- public API -------------------------------------------------------------------------

    def get(self, sha256: str) -> Document | None:
        """Return the stored document with this full SHA-256, or None."""
        sha256 = sha256.lower()
        if not _SHA_RE.fullmatch(sha256):
            return None
        data = self._read(self.path_for(sha256))
        if data is None or data.get("format") != FORMAT_VERSION:  # an older reader's entry: parse the file again
            return None
        try:
            return Document.from_dict(data)
        except ValueError:
            return None

    def put(self, doc: Document) -> Path:
        """Store ``doc`` atomically (replacing any entry with the same hash); return its path."""
        if not _SHA_RE.fullmatch(doc.sha256):
            raise ValueError(f"not a SHA-256 hex digest: {doc.sha256!r}")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temps()
        record = {
            "format": FORMAT_VERSION,
            "ingested_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "n_pages": len(doc.pages),
            "n_chars": doc.n_chars,
            **doc.to_dict(),
        }
        payload = json.dumps(record, ensure_ascii=False).encode("utf-8")
        target = self.path_for(doc.sha256)
        # the temporary file's name is the one ``_remove_stale_temps`` recognises
        with atomic_file(target, prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX) as fh:
            _write_all(fh, payload)
        _fsync_dir(self.folder)
        return target

    def list(self) -> builtins.list[StoreEntry]:
        """All readable entries, oldest ingestion first."""
        entries: builtins.list[StoreEntry] = []
        for path in self._entry_files():
            data = self._read(path)
            if data is None:
                continue
            try:
                pages = data["pages"]
                entry = StoreEntry(
                    sha256=str(data["sha256"]),
                    source=str(data["source"]),
                    kind=str(data["kind"]),
                    pages=int(data.get("n_pages", len(pages))),
                    chars=int(data.get("n_chars", 0)),
                    ingested_at=str(data.get("ingested_at", "")),
                    path=path,
                )
            except (KeyError, TypeError, ValueError):
                continue
            entries.append(entry)
        entries.sort(key=lambda e: (e.ingested_at, e.name, e.sha256))
        return entries

    def find(self, key: str) -> StoreEntry:
        """Resolve ``key`` (a hash prefix of >= 6 characters, a source file name or path, or a file on disk: the
        entry of its content, whatever name it was stored under)."""
        key = key.strip()
        if not key:
            raise UsageError("Give a document to remove: a hash prefix (6+ characters) or a file name.")
        entries = self.list()
        matches: dict[str, StoreEntry] = {}
        if _HEX_RE.fullmatch(key) and len(key) >= MIN_PREFIX:
            for entry in entries:
                if entry.sha256.startswith(key.lower()):
                    matches[entry.sha256] = entry
        absolute = os.path.abspath(os.path.expanduser(key))  # a relative path names the stored absolute source
        for entry in entries:
            if key in (entry.name, entry.source) or absolute == entry.source:
                matches[entry.sha256] = entry
        if (not matches or len(matches) > 1) and os.path.isfile(absolute):
            # the file itself: stored under another name or place, or (a path that names several versions of an
            # edited file) the version of its present bytes
            try:
                with open(absolute, "rb") as handle:
                    sha = hash_bytes(handle.read())
            except OSError:
                sha = ""
            present = {e.sha256: e for e in entries if e.sha256 == sha}
            if present:
                matches = present
        if not matches:
            if _HEX_RE.fullmatch(key) and len(key) < MIN_PREFIX:
                raise UsageError(
                    f"'{key}' is too short to match a hash; give at least {MIN_PREFIX} characters "
                    "or the document's file name."
                )
            raise MaskKVError(  # not found: exit 1, as every other missing thing
                f"No stored document matches '{key}'; `maskkv ingest --list` shows the stored documents' "
                "hashes and names."
            )
        if len(matches) > 1:
            found = ", ".join(f"{e.short} ({e.name}, stored {e.ingested_at[:19].replace('T', ' ')})"
                              for e in matches.values())
            raise UsageError(f"'{key}' matches {len(matches)} stored documents: {found}; give the hash of the one to "
                             "remove.")
        return next(iter(matches.values()))

    def remove(self, key: str) -> StoreEntry:
        """Delete one stored document, chosen as in ``find``; return what was removed."""
        entry = self.find(key)
        try:
            entry.path.unlink()
        except FileNotFoundError:
            pass
        return entry

    def ingest(
        self, path: str | Path, password: str | None = None, *, must_store: bool = False
    ) -> tuple[Document, bool]:
        """Load ``path`` through the store; return ``(document, came_from_cache)``.

        The file is hashed first; a stored copy is returned (with ``source`` set to this
        path, its notes naming this file) without parsing the file again, where it was read as
        the same kind (the same bytes as Markdown and as text are two readings: the latest is
        stored) and, for an encrypted PDF, ``password`` opens it.  Otherwise it is
        loaded and stored.  When the store cannot be written the document is still returned with
        a warning, unless ``must_store`` (storing is the point, as for ``maskkv ingest``): then it
        raises.
        """
        p, kind, data = read_source(path)
        source = os.path.abspath(p)
        sha = hash_bytes(data)
        cached = self.get(sha)
        if cached is not None and cached.kind == kind:
            if kind == "pdf":
                from maskkv_cli.documents.pdf import check_password

                check_password(data, p.name, password)
            if cached.source != source:
                old, new = cached.name, Path(source).name
                notes = tuple(w.replace(old, new) for w in cached.warnings) if old and old != new else cached.warnings
                cached = replace(cached, source=source, warnings=notes)
            return cached, True
        doc = parse_document(data, source=source, kind=kind, password=password)
        try:
            self.put(doc)
        except OSError as exc:  # a read-only or full cache must not stop the user
            reason = exc.strerror or str(exc)
            if must_store:
                raise MaskKVError(
                    f"Could not save {doc.name} to the document store in {self.folder} ({reason}); "
                    "check that the folder is writable and the disk has room, or set MASKKV_HOME "
                    "to another folder."
                ) from None
            note = f"Could not save {doc.name} to the document cache in {self.folder} ({reason})."
            doc = replace(doc, warnings=(*doc.warnings, note))
        return doc, False

    # -- housekeeping -----------------------------------------------------------------------

    def _remove_stale_temps(self) -> None:
        """Delete temp files left by writers that died more than an hour ago."""
        now = time.time()
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            if not (name.startswith(_TEMP_PREFIX) and name.endswith(_TEMP_SUFFIX)):
                continue
            path = self.folder / name
            try:
                if now - path.stat().st_mtime > _STALE_TEMP_SECONDS:
                    path.unlink()
            except OSError:
                pass
