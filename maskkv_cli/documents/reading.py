"""Load documents (PDF, plain text, Markdown) into cleaned text split into pages.

``load_document`` is the entry point.  Every problem a user can fix is raised as a
``DocumentError`` whose message says what went wrong and what to do; problems that still leave
usable text (blank pages, a damaged PDF we could partly read, a legacy text encoding) end up in
``Document.warnings``.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from maskkv_cli.errors import DocumentError

KINDS = ("pdf", "text", "markdown")
EXTENSIONS: dict[str, str] = {
    ".pdf": "pdf",
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
}
SUPPORTED_HINT = ".pdf, .txt, .text, .md, .markdown (or a plain-text file with no extension)"

TEXT_PAGE_CHARS = 3000  # target size of a "page" of a text file without form feeds
PAGE_SEPARATOR = "\n\n"


# --------------------------------------------------------------------------------------------
# Data model


@dataclass(frozen=True)
class Page:
    number: int  # 1-based; for PDFs the page number in the file
    text: str


@dataclass(frozen=True)
class Document:
    source: str
    kind: str  # "pdf" | "text" | "markdown"
    pages: tuple[Page, ...]
    sha256: str  # of the file's bytes
    warnings: tuple[str, ...] = field(default=())

    @cached_property
    def text(self) -> str:
        return PAGE_SEPARATOR.join(page.text for page in self.pages)

    @property
    def n_chars(self) -> int:
        return len(self.text)

    @property
    def name(self) -> str:
        return Path(self.source).name

    @cached_property
    def _starts(self) -> list[int]:
        starts: list[int] = []
        offset = 0
        for page in self.pages:
            starts.append(offset)
            offset += len(page.text) + len(PAGE_SEPARATOR)
        return starts

    def page_spans(self) -> list[tuple[int, int, int]]:
        """Return ``(page_number, start, end)`` for each page; ``text[start:end]`` is its text."""
        return [
            (page.number, start, start + len(page.text))
            for page, start in zip(self.pages, self._starts, strict=True)
        ]

    def page_at(self, char_offset: int) -> int:
        """Return the page number holding ``char_offset`` of ``text``.

        Offsets inside the separator after a page belong to that page; ``n_chars`` itself maps
        to the last page so that an exclusive end offset can be looked up too.
        """
        if not self.pages:
            raise ValueError("document has no pages")
        if char_offset < 0 or char_offset > self.n_chars:
            raise ValueError(f"offset {char_offset} is outside the document (0..{self.n_chars})")
        index = bisect.bisect_right(self._starts, char_offset) - 1
        return self.pages[index].number

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.kind,
            "sha256": self.sha256,
            "warnings": list(self.warnings),
            "pages": [{"number": page.number, "text": page.text} for page in self.pages],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Document:
        """Rebuild a document from ``to_dict`` output; raises ValueError when it does not fit."""
        try:
            pages = tuple(Page(number=int(p["number"]), text=str(p["text"])) for p in data["pages"])
            doc = cls(
                source=str(data["source"]),
                kind=str(data["kind"]),
                pages=pages,
                sha256=str(data["sha256"]),
                warnings=tuple(str(w) for w in data.get("warnings", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a stored document: {exc}") from exc
        if doc.kind not in KINDS:
            raise ValueError(f"unknown document kind {doc.kind!r}")
        return doc


# --------------------------------------------------------------------------------------------
# Small helpers


def format_page_ranges(numbers: list[int] | tuple[int, ...]) -> str:
    """``[1, 2, 3, 7, 9, 10]`` -> ``"1-3, 7, 9-10"``."""
    ordered = sorted(set(numbers))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(parts)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _pages_label(numbers: list[int]) -> str:
    """``[5]`` -> ``"page 5"``; ``[4, 5]`` -> ``"pages 4-5"``."""
    return ("page " if len(set(numbers)) == 1 else "pages ") + format_page_ranges(numbers)


# --------------------------------------------------------------------------------------------
# Reading files


def detect_kind(path: Path, head: bytes | None = None) -> str:
    """Return the document kind for ``path`` from its extension (or, without one, its bytes)."""
    suffix = path.suffix.lower()
    if suffix in EXTENSIONS:
        return EXTENSIONS[suffix]
    if suffix == "":
        if head is not None and head.lstrip()[:5] == b"%PDF-":
            return "pdf"
        return "text"
    raise DocumentError(
        f"Cannot read {path}: unsupported file type '{path.suffix}'. "
        f"Supported: {SUPPORTED_HINT}; convert the file to one of these first."
    )


def read_source(path: str | Path) -> tuple[Path, str, bytes]:
    """Check and read a document file; return ``(path, kind, bytes)`` or raise DocumentError."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DocumentError(f"File not found: {p}. Check the path and try again.")
    if p.is_dir():
        raise DocumentError(f"{p} is a directory; pass a single document file ({SUPPORTED_HINT}).")
    if p.suffix:
        detect_kind(p)  # reject an unsupported extension before reading the file
    try:
        data = p.read_bytes()
    except PermissionError:
        raise DocumentError(f"Cannot read {p}: permission denied. Check the file's permissions.") from None
    except OSError as exc:
        raise DocumentError(f"Cannot read {p}: {exc.strerror or exc}. Check the file.") from None
    if not data:
        raise DocumentError(f"{p} is empty (0 bytes); pass a file that contains text.")
    return p, detect_kind(p, data[:1024]), data


def load_document(path: str | Path, password: str | None = None) -> Document:
    """Read a PDF, text or Markdown file into a cleaned, paged ``Document``."""
    p, kind, data = read_source(path)
    return parse_document(data, source=os.path.abspath(p), kind=kind, password=password)


def parse_document(data: bytes, *, source: str, kind: str, password: str | None = None) -> Document:
    """Build a ``Document`` from file bytes already read (``kind`` from ``detect_kind``)."""
    display = Path(source).name or source
    if kind == "pdf":
        from maskkv_cli.documents.pdf import load_pdf

        pages, notes = load_pdf(data, display, password)
    elif kind in ("text", "markdown"):
        from maskkv_cli.documents.text import load_text

        pages, notes = load_text(data, display, kind)
    else:
        raise ValueError(f"unknown document kind {kind!r}")
    return Document(
        source=source,
        kind=kind,
        pages=tuple(pages),
        sha256=hashlib.sha256(data).hexdigest(),
        warnings=tuple(notes),
    )


__all__ = [
    "Document",
    "Page",
    "detect_kind",
    "format_page_ranges",
    "load_document",
    "parse_document",
    "read_source",
]
