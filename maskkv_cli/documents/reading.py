"""Load documents (PDF, plain text, Markdown) into cleaned text split into pages.

``load_document`` is the entry point.  Every problem a user can fix is raised as a
``DocumentError`` whose message says what went wrong and what to do; problems that still leave
usable text (blank pages, a damaged PDF we could partly read, a legacy text encoding) end up in
``Document.warnings``.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from maskkv_cli.documents.model import Document
from maskkv_cli.errors import DocumentError

EXTENSIONS: dict[str, str] = {
    ".pdf": "pdf",
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
}
SUPPORTED_HINT = ".pdf, .txt, .text, .md, .markdown (or a plain-text file with no extension)"

# --------------------------------------------------------------------------------------------
# Reading files


def detect_kind(path: Path, head: bytes | None = None) -> str:
    """Return the document kind for ``path`` from its extension (or, without one, its bytes). Bytes that start
    as a PDF's do (``%PDF-``) are a PDF under a text extension too (a PDF saved as ``.txt`` is no text to read)."""
    suffix = path.suffix.lower()
    is_pdf = head is not None and head.lstrip()[:5] == b"%PDF-"
    if suffix in EXTENSIONS:
        return "pdf" if is_pdf else EXTENSIONS[suffix]
    if suffix == "":
        return "pdf" if is_pdf else "text"
    raise DocumentError(
        f"Cannot read {path}: unsupported file type '{path.suffix}'. "
        f"Supported: {SUPPORTED_HINT}; convert the file to one of these first."
    )


def check_source(path: str | Path) -> Path:
    """The document's path when it can be one (it exists, is a file, has a supported extension or none); else
    DocumentError. Light (no file is read, nothing heavy imported): commands check their document first, so that a
    wrong path fails at once, before the model is loaded."""
    p = Path(path).expanduser()
    if not p.exists():
        scheme = re.match(r"(https?|ftp):/+", str(path))  # (a Path has folded the scheme's "//" into "/")
        if scheme:
            address = f"{scheme.group(1)}://{str(path)[scheme.end():]}"
            raise DocumentError(f"{address} is a web address: maskkv reads local files; download it first (curl -LO "
                                f"{address}) and pass the file.")
        raise DocumentError(f"File not found: {p}. Check the path and try again.")
    if p.is_dir():
        raise DocumentError(f"{p} is a directory; pass a single document file ({SUPPORTED_HINT}).")
    if not p.is_file():  # a FIFO, a socket, a device: reading it could wait forever
        raise DocumentError(f"{p} is not a regular file (a pipe, socket or device); pass a document file "
                            f"({SUPPORTED_HINT}).")
    if p.suffix:
        detect_kind(p)  # reject an unsupported extension before reading the file
    return p


def read_source(path: str | Path) -> tuple[Path, str, bytes]:
    """Check and read a document file; return ``(path, kind, bytes)`` or raise DocumentError."""
    p = check_source(path)
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
    from maskkv_cli.documents.textlayer import screen_pages

    pages, damaged = screen_pages(pages, display)
    notes = [*notes, *damaged]
    return Document(
        source=source,
        kind=kind,
        pages=tuple(pages),
        sha256=hashlib.sha256(data).hexdigest(),
        warnings=tuple(notes),
    )


__all__ = ["EXTENSIONS", "check_source", "detect_kind", "load_document", "parse_document", "read_source"]
