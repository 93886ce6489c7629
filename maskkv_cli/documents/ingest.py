"""Ingest many documents at once: find them under files and folders, then load each on its own.

The per-file rule: every file is read, parsed and stored independently, and whatever goes wrong
with one file (damaged, encrypted, unreadable, a store that cannot be written) becomes that file's
``Outcome`` with a one-line ``error``; the next file goes on.  Commands that take many documents
(``maskkv ingest``, later ``maskkv batch``) call ``discover`` and ``ingest_all`` and render the
outcomes; nothing here prints.

Each stored document is one atomic write in the store (``DocumentStore.put``), so a process killed
halfway through a folder leaves only complete entries, and running it again stores the rest
(files already stored are recognised by their hash and not parsed again).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maskkv_cli.documents import EXTENSIONS, Document
from maskkv_cli.documents.store import DocumentStore
from maskkv_cli.errors import MaskKVError

STATUSES = ("stored", "already", "failed", "skipped")
FOLDER_SUFFIXES = frozenset(EXTENSIONS)  # what a folder walk picks up: .pdf, .txt, .text, .md, .markdown
FOLDER_HINT = ".pdf, .txt, .text, .md or .markdown"


@dataclass(frozen=True)
class Outcome:
    """What happened to one input file."""

    path: Path  # as given on the command line, or found in a folder
    status: str  # one of STATUSES
    document: Document | None = None  # the loaded document when stored or already in the store
    tokens: int | None = None
    token_method: str | None = None
    error: str | None = None  # one line, for failures

    @property
    def ok(self) -> bool:
        return self.status in ("stored", "already")

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready row; every row has the same keys, null where a value does not apply."""
        doc = self.document
        return {
            "source": str(self.path),
            "status": self.status,
            "sha256": doc.sha256 if doc else None,
            "kind": doc.kind if doc else None,
            "pages": len(doc.pages) if doc else None,
            "chars": doc.n_chars if doc else None,
            "tokens": self.tokens,
            "token_method": self.token_method,
            "cached": self.status == "already",
            "warnings": list(doc.warnings) if doc else [],
            "error": self.error,
        }


@dataclass
class Tally:
    """Counts of outcomes by status, and the summary line commands print at the end."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATUSES, 0))

    def add(self, outcome: Outcome) -> None:
        self.counts[outcome.status] += 1

    @property
    def failed(self) -> int:
        return self.counts["failed"]

    def summary(self) -> str:
        """E.g. ``14 stored, 2 already in the store, 3 failed, 5 skipped``; zero counts are left out."""
        words = {"stored": "stored", "already": "already in the store", "failed": "failed",
                 "skipped": f"skipped (not {FOLDER_HINT})"}
        parts = [f"{self.counts[s]} {words[s]}" for s in STATUSES if self.counts[s]]
        return ", ".join(parts) if parts else "no files to ingest"


@dataclass(frozen=True)
class Discovery:
    """The documents to ingest, in order, and the folder files that were skipped."""

    files: list[Path]
    skipped: list[Path]


def _walk(folder: Path) -> tuple[list[Path], list[Path]]:
    """Supported and other files under ``folder``, recursively, in sorted path order.

    Hidden files and folders (names starting with a dot) are left out, and symlinked folders are
    not followed (no loops).
    """
    found: list[Path] = []
    for root, dirs, names in os.walk(folder, followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(Path(root) / n for n in names if not n.startswith("."))
    found.sort(key=lambda p: p.relative_to(folder).parts)
    keep = [p for p in found if p.suffix.lower() in FOLDER_SUFFIXES]
    other = [p for p in found if p.suffix.lower() not in FOLDER_SUFFIXES]
    return keep, other


def discover(paths: Iterable[str | Path]) -> Discovery:
    """Expand ``paths`` (files and folders) into the files to ingest.

    A folder contributes its .pdf/.txt/.text/.md/.markdown files, recursively; its other files are
    skipped.  A path given directly is always tried, whatever its type (a missing or unsupported
    one becomes a failure with a message).  A file reached twice is taken once.
    """
    files: list[Path] = []
    skipped: list[Path] = []
    seen: set[str] = set()

    def take(path: Path, into: list[Path]) -> None:
        key = os.path.abspath(path)
        if key not in seen:
            seen.add(key)
            into.append(path)

    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            keep, other = _walk(path)
            for p in keep:
                take(p, files)
            for p in other:
                take(p, skipped)
        else:
            take(path, files)
    return Discovery(files=files, skipped=skipped)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, MaskKVError):
        return str(exc)
    if isinstance(exc, MemoryError):
        return "ran out of memory while reading it; free memory or split the file"
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"unexpected {type(exc).__name__}{': ' + first if first else ''} (run with --debug for the traceback)"


def ingest_one(
    store: DocumentStore,
    path: Path,
    *,
    password: str | None = None,
    tokenizer: Any = None,
    debug: bool = False,
    must_store: bool = True,
) -> Outcome:
    """Load ``path`` through ``store`` and count its tokens; never raises for a problem with the file.

    Problems a user can fix (``MaskKVError``, e.g. a damaged PDF or, with ``must_store``, a store that cannot be
    written) and any other error while reading this one file become a ``failed`` outcome.  Without
    ``must_store`` (a command that only reads the documents, as ``batch``) a store that cannot be written leaves
    the document loaded, with a warning.  With ``debug`` errors that are not ``MaskKVError`` propagate, so their
    traceback can be seen.
    """
    from maskkv_cli.documents.tokens import count_tokens

    try:
        doc, cached = store.ingest(path, password=password, must_store=must_store)
        tokens, method = count_tokens(doc.text, tokenizer)
    except MaskKVError as exc:
        return Outcome(path=path, status="failed", error=_one_line(exc))
    except Exception as exc:
        if debug:
            raise
        return Outcome(path=path, status="failed", error=_one_line(exc))
    return Outcome(path=path, status="already" if cached else "stored", document=doc, tokens=tokens,
                   token_method=method)


def ingest_all(
    store: DocumentStore,
    files: Iterable[Path],
    *,
    password: str | None = None,
    tokenizer: Any = None,
    debug: bool = False,
    on_start: Callable[[Path], None] | None = None,
    must_store: bool = True,
) -> Iterator[Outcome]:
    """Ingest ``files`` one after the other (see ``ingest_one``, also for ``must_store``), yielding each file's
    outcome.

    ``on_start`` is called with each path before it is read (for a progress display).
    """
    for path in files:
        if on_start is not None:
            on_start(path)
        yield ingest_one(store, path, password=password, tokenizer=tokenizer, debug=debug, must_store=must_store)


def skipped_outcomes(discovery: Discovery) -> list[Outcome]:
    return [Outcome(path=p, status="skipped") for p in discovery.skipped]


__all__ = ["Discovery", "Outcome", "Tally", "discover", "ingest_all", "ingest_one", "skipped_outcomes"]
