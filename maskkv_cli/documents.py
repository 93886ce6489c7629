"""Load documents (PDF, plain text, Markdown) into cleaned text split into pages.

``load_document`` is the entry point.  Every problem a user can fix is raised as a
``DocumentError`` whose message says what went wrong and what to do; problems that still leave
usable text (blank pages, a damaged PDF we could partly read, a legacy text encoding) end up in
``Document.warnings``.
"""

from __future__ import annotations

import bisect
import codecs
import hashlib
import logging
import os
import re
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from io import BytesIO
from itertools import pairwise
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
# Cleaning

_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"), None)
_SPACES = dict.fromkeys(map(ord, "\u00a0\u2007\u202f\u205f\u3000\u1680\u000b"), " ")
_SPACES.update(dict.fromkeys(range(0x2000, 0x200B), " "))
_LIGATURES = {ord("\ufb00"): "ff", ord("\ufb01"): "fi", ord("\ufb02"): "fl", ord("\ufb03"): "ffi",
              ord("\ufb04"): "ffl", ord("\ufb05"): "st", ord("\ufb06"): "st"}
# Control characters other than newline and tab, which are handled separately.
_CONTROLS = dict.fromkeys([c for c in range(32) if c not in (9, 10)] + [127], None)
_CHAR_MAP: dict[int, str | None] = {**_CONTROLS, **_ZERO_WIDTH, **_SPACES, **_LIGATURES}

_MULTI_SPACE = re.compile(r" {2,}")
_MANY_NEWLINES = re.compile(r"\n{3,}")
_HYPHEN_BREAK = re.compile(r"([^\W\d_])-\n(?=(\S))")
_LIST_ITEM = re.compile(r"^(?:[-*+•‣◦▪▫–—]\s|\(?\d{1,3}[.)]\s|\(?[ivxIVX]{1,4}\)\s|\([a-z]\)\s)")
_SENTENCE_END = tuple(".!?:;\"'”’)]")


def _normalise_whitespace(text: str, keep_indent: bool) -> str:
    """Unify newlines, drop zero-width and control characters, squeeze spaces."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").translate(_CHAR_MAP)
    lines: list[str] = []
    for line in text.split("\n"):
        line = line.rstrip()
        if keep_indent:
            body = line.lstrip(" \t")
            indent = line[: len(line) - len(body)].replace("\t", "    ")
            line = indent + _MULTI_SPACE.sub(" ", body.replace("\t", " "))
        else:
            line = _MULTI_SPACE.sub(" ", line.replace("\t", " ")).strip()
        lines.append(line)
    text = "\n".join(lines)
    return _MANY_NEWLINES.sub("\n\n", text).strip("\n")


def _line_key(line: str) -> str:
    return re.sub(r"\d+", "#", " ".join(line.split())).casefold()


def _edge_line_index(lines: list[str], last: bool) -> int | None:
    order = range(len(lines) - 1, -1, -1) if last else range(len(lines))
    for i in order:
        if lines[i].strip():
            return i
    return None


def _drop_repeated_edges(pages: list[str]) -> list[str]:
    """Remove running headers and footers.

    A first (or last) non-empty line is dropped when the same line, with digits ignored,
    starts (or ends) at least half of the non-empty pages, given at least three of them.
    A page's last remaining line is never dropped.
    """
    split = [page.split("\n") for page in pages]
    filled = [i for i, page in enumerate(pages) if page.strip()]
    if len(filled) < 3:
        return pages
    for _ in range(2):  # a header may take two lines (title, then page number)
        changed = False
        for last in (False, True):
            keys: dict[int, str] = {}
            for i in filled:
                # never strip a page's last remaining line: that is body text, not a header
                if sum(1 for line in split[i] if line.strip()) >= 2:
                    idx = _edge_line_index(split[i], last)
                    assert idx is not None
                    keys[i] = _line_key(split[i][idx])
            counts = Counter(keys.values())
            repeated = {k for k, n in counts.items() if n >= 2 and 2 * n >= len(filled)}
            for i, key in keys.items():
                if key in repeated:
                    idx = _edge_line_index(split[i], last)
                    assert idx is not None
                    del split[i][idx]
                    changed = True
        if not changed:
            break
    return ["\n".join(lines).strip("\n") for lines in split]


def _join_hyphenated(text: str) -> str:
    def repl(match: re.Match[str]) -> str:
        if match.group(2).islower():
            return match.group(1)
        return match.group(0)

    return _HYPHEN_BREAK.sub(repl, text)


def _keeps_break(prev: str, nxt: str, width: int) -> bool:
    """Whether the newline between two lines of a PDF paragraph is a real break."""
    if _LIST_ITEM.match(nxt):
        return True
    short = width >= 30 and len(prev) < 0.6 * width
    if short and (prev.endswith(_SENTENCE_END) or nxt[:1].isupper() or not nxt[:1].isalpha()):
        return True
    return False


def _unwrap(page: str) -> str:
    """Join lines that were wrapped inside a paragraph; keep blank lines and list items."""
    lines = page.split("\n")
    width = max((len(line) for line in lines), default=0)
    paragraphs: list[str] = []
    for block in page.split("\n\n"):
        rows = [row for row in block.split("\n") if row.strip()]
        if not rows:
            continue
        out = [rows[0]]
        for prev, nxt in pairwise(rows):
            if _keeps_break(prev, nxt, width):
                out.append(nxt)
            else:
                out[-1] = f"{out[-1]} {nxt}"
        paragraphs.append("\n".join(out))
    return "\n\n".join(paragraphs)


def clean_text(
    pages: list[str],
    *,
    unwrap_lines: bool = True,
    join_hyphens: bool = True,
    drop_headers: bool = True,
) -> list[str]:
    """Clean page texts; returns one string per input page (possibly empty).

    - normalise whitespace: ``\\r``, tabs, NBSP and other odd spaces, zero-width characters,
      soft hyphens, ligatures, runs of spaces, runs of blank lines;
    - drop running headers/footers (see ``_drop_repeated_edges``) when ``drop_headers``;
    - join words hyphenated at a line end ("exam-\\nple" -> "example") when the next line
      starts with a lowercase letter, when ``join_hyphens``;
    - unwrap single newlines inside paragraphs (text extracted from PDFs), when ``unwrap_lines``.

    The defaults suit PDF text; plain text files use ``unwrap_lines=False`` so their layout
    (and Markdown structure) stays as written.
    """
    cleaned = [_normalise_whitespace(page, keep_indent=not unwrap_lines) for page in pages]
    if drop_headers:
        cleaned = _drop_repeated_edges(cleaned)
    if join_hyphens:
        cleaned = [_join_hyphenated(page) for page in cleaned]
    if unwrap_lines:
        cleaned = [_unwrap(page) for page in cleaned]
    return [page.strip() for page in cleaned]


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
        pages, notes = _load_pdf(data, display, password)
    elif kind in ("text", "markdown"):
        pages, notes = _load_text(data, display, kind)
    else:
        raise ValueError(f"unknown document kind {kind!r}")
    return Document(
        source=source,
        kind=kind,
        pages=tuple(pages),
        sha256=hashlib.sha256(data).hexdigest(),
        warnings=tuple(notes),
    )


# --------------------------------------------------------------------------------------------
# Text files

_BINARY_CONTROLS = bytes(c for c in range(32) if c not in (9, 10, 11, 12, 13, 27)) + b"\x7f"
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def _looks_binary(data: bytes) -> bool:
    sample = data[: 1 << 16]
    if b"\x00" in sample:
        return True
    controls = len(sample) - len(sample.translate(None, _BINARY_CONTROLS))
    return controls > 0.05 * len(sample)


def _mostly_printable(text: str) -> bool:
    sample = text[: 1 << 16]
    if not sample:
        return True
    good = sum(1 for ch in sample if ch.isprintable() or ch in "\n\t\r\f\v")
    return good >= 0.97 * len(sample)


def _decode_text(data: bytes, display: str) -> tuple[str, list[str]]:
    notes: list[str] = []
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError:
            raise DocumentError(
                f"{display} starts with a UTF-16 marker but is not valid UTF-16; "
                "re-save it as UTF-8 and try again."
            ) from None
        if not _mostly_printable(text):
            raise DocumentError(f"{display} looks binary, not text; pass a text, Markdown or PDF file.")
        return text, notes
    if data.startswith(codecs.BOM_UTF8):
        text = data.decode("utf-8-sig", errors="replace")
        if "\ufffd" in text and "\ufffd".encode() not in data:
            notes.append(f"{display} has bytes that are not valid UTF-8; they were replaced with '\ufffd'.")
        return text, notes
    if _looks_binary(data):
        raise DocumentError(
            f"{display} looks binary (it contains NUL or control bytes), not text; "
            f"pass a text, Markdown or PDF file."
        )
    try:
        return data.decode("utf-8"), notes
    except UnicodeDecodeError:
        pass
    for encoding, label in (("cp1252", "Windows-1252"), ("latin-1", "Latin-1")):
        try:
            text = data.decode(encoding)
        except UnicodeDecodeError:
            continue
        if _mostly_printable(text):
            notes.append(f"{display} is not UTF-8; it was read as {label}. Convert it to UTF-8 if "
                         "some characters look wrong.")
            return text, notes
    raise DocumentError(
        f"{display} is not UTF-8 and does not look like text in another common encoding; "
        "convert it to UTF-8 (e.g. with iconv) and try again."
    )


def _blocks(text: str, kind: str) -> list[str]:
    """Split text into paragraphs; for Markdown a fenced code block stays one block."""
    raw = re.split(r"\n[ \t]*\n", text)
    if kind != "markdown":
        return [b for b in raw if b.strip()]
    blocks: list[str] = []
    open_fence: list[str] = []
    for block in raw:
        fences = sum(1 for line in block.split("\n") if _FENCE.match(line))
        if open_fence:
            open_fence.append(block)
            if fences % 2 == 1:
                blocks.append("\n\n".join(open_fence))
                open_fence = []
        elif fences % 2 == 1:
            open_fence = [block]
        elif block.strip():
            blocks.append(block)
    if open_fence:
        blocks.append("\n\n".join(open_fence))
    return blocks


def _split_long(block: str, limit: int) -> list[str]:
    """Cut a block longer than ``limit`` at line ends, else at spaces, else anywhere."""
    pieces: list[str] = []
    start, end = 0, len(block)
    while end - start > limit:
        floor = start + limit // 3
        cut = block.rfind("\n", start, start + limit + 1)
        if cut <= floor:
            cut = block.rfind(" ", start, start + limit + 1)
        if cut <= floor:
            cut = start + limit
        piece = block[start:cut].rstrip()
        if piece:
            pieces.append(piece)
        start = cut
        while start < end and block[start] in " \n":
            start += 1
    if start < end:
        pieces.append(block[start:end])
    return pieces


def split_text_pages(text: str, kind: str = "text", limit: int = TEXT_PAGE_CHARS) -> list[str]:
    """Cut a long text into pages of about ``limit`` characters at paragraph boundaries.

    Deterministic: the same text always gives the same pages.  Markdown prefers to start a
    page at a heading once the current page is half full, and never cuts a fenced code block
    unless the block alone is longer than a page.
    """
    pages: list[str] = []
    current: list[str] = []
    size = 0
    for block in _blocks(text, kind):
        for piece in _split_long(block, limit) if len(block) > limit else [block]:
            heading = kind == "markdown" and piece.lstrip().startswith("#")
            if current and (size + 2 + len(piece) > limit or (heading and size >= limit // 2)):
                pages.append("\n\n".join(current))
                current, size = [], 0
            current.append(piece)
            size += len(piece) + (2 if size else 0)
    if current:
        pages.append("\n\n".join(current))
    return pages


def _load_text(data: bytes, display: str, kind: str) -> tuple[list[Page], list[str]]:
    text, notes = _decode_text(data, display)
    if not text.strip():
        raise DocumentError(f"{display} contains only whitespace; pass a file that contains text.")
    form_feeds = "\f" in text
    if form_feeds:
        raw_pages = text.split("\f")
    else:
        raw_pages = split_text_pages(_normalise_whitespace(text, keep_indent=True), kind)
    cleaned = clean_text(
        raw_pages,
        unwrap_lines=False,
        join_hyphens=kind == "text",
        drop_headers=form_feeds,
    )
    pages = [Page(number=i + 1, text=t) for i, t in enumerate(cleaned) if t]
    if not pages:
        raise DocumentError(f"{display} contains no readable text; pass a file that contains text.")
    return pages, notes


# --------------------------------------------------------------------------------------------
# PDF files


class _Collect(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


@contextmanager
def _quiet_pypdf() -> Iterator[list[str]]:
    """Collect pypdf's log messages instead of letting them reach the terminal."""
    logger = logging.getLogger("pypdf")
    messages: list[str] = []
    handler = _Collect(messages)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _aes_error(display: str) -> DocumentError:
    return DocumentError(
        f"{display} is AES-encrypted and reading it needs the 'cryptography' package; "
        "run: pip install 'pypdf[crypto]'"
    )


def _unlock(reader: Any, password: str | None, display: str) -> None:
    from pypdf import PasswordType
    from pypdf.errors import DependencyError

    if not reader.is_encrypted:
        return
    try:
        if reader.decrypt("") != PasswordType.NOT_DECRYPTED:
            return
        if password is None:
            raise DocumentError(f"{display} is password-protected; pass its password with --password.")
        if reader.decrypt(password) == PasswordType.NOT_DECRYPTED:
            raise DocumentError(f"Wrong password for {display}; check the value passed with --password.")
    except DependencyError:
        raise _aes_error(display) from None
    except DocumentError:
        raise
    except Exception as exc:
        raise DocumentError(
            f"Cannot decrypt {display} ({exc}); its encryption is not supported. "
            "Save an unencrypted copy and load that."
        ) from None


def _with_inherited(page: Any, node: Any) -> Any:
    """Copy inheritable attributes (resources, boxes, rotation) from ``node``'s ancestors."""
    from pypdf.generic import DictionaryObject

    parent = node.get("/Parent")
    for _ in range(64):
        try:
            parent = parent.get_object() if parent is not None else None
        except Exception:
            break
        if not isinstance(parent, DictionaryObject):
            break
        for key in ("/Resources", "/MediaBox", "/CropBox", "/Rotate"):
            if key not in page and key in parent:
                page[key] = parent.raw_get(key)
        parent = parent.get("/Parent")
    return page


def _walk_page_tree(reader: Any) -> tuple[list[Any], int]:
    """Walk /Pages of a damaged file; return (slots, declared count), None for unreadable kids."""
    from pypdf import PageObject
    from pypdf.generic import DictionaryObject, IndirectObject

    root = reader.root_object.get("/Pages")
    root = root.get_object() if root is not None else None
    if not isinstance(root, DictionaryObject):
        raise ValueError("no page tree")
    slots: list[Any] = []
    seen: set[int] = set()

    def visit(node: Any, depth: int) -> None:
        if depth > 64 or id(node) in seen:
            return
        seen.add(id(node))
        try:
            kids = node.get("/Kids")
            kids = kids.get_object() if kids is not None else []
        except Exception:
            kids = []
        for kid in kids:
            try:
                obj = kid.get_object()
            except Exception:
                obj = None
            if not isinstance(obj, DictionaryObject) or not obj:
                slots.append(None)
            elif obj.get("/Type") == "/Pages" or "/Kids" in obj:
                visit(obj, depth + 1)
            else:
                if isinstance(kid, IndirectObject):
                    page = PageObject(reader, kid)
                else:
                    page = PageObject(reader, None)
                    page.update(obj)
                slots.append(_with_inherited(page, obj))

    visit(root, 0)
    try:
        declared = int(root.get("/Count", 0))
    except (TypeError, ValueError):
        declared = 0
    return slots, declared


def _scan_page_objects(reader: Any) -> list[Any]:
    """Find /Page objects anywhere in the file, in object-number order."""
    from pypdf import PageObject
    from pypdf.generic import DictionaryObject, IndirectObject

    numbers: dict[int, int] = {}
    for generation, table in reader.xref.items():
        for number in table:
            numbers.setdefault(number, generation)
    for number in reader.xref_objStm:
        numbers.setdefault(number, 0)
    pages: list[Any] = []
    for number in sorted(numbers):
        try:
            ref = IndirectObject(number, numbers[number], reader)
            obj = ref.get_object()
        except Exception:
            continue
        if isinstance(obj, DictionaryObject) and obj.get("/Type") == "/Page":
            pages.append(_with_inherited(PageObject(reader, ref), obj))
    return pages


def _open_repaired(
    data: bytes, display: str, password: str | None, limits: list[str]
) -> tuple[list[Any], int, bool]:
    """Re-open a PDF pypdf could not read, rebuilding its cross-reference table.

    Returns (page slots, expected page count, whether page order is a guess).  pypdf's safety
    limits hit on the way are appended to ``limits``; when nothing can be recovered they, not
    "damaged", are what the error names.
    """
    from pypdf import PdfReader
    from pypdf.errors import DependencyError
    from pypdf.generic import NameObject, NumberObject

    def unreadable() -> DocumentError:
        if limits:
            return _limit_error(display, limits[0])
        return DocumentError(
            f"{display} is damaged or truncated and no page could be recovered; "
            "get a fresh copy of the file (re-download or re-export it)."
        )

    # A trailing startxref of 0 makes pypdf rebuild its cross-reference table by scanning.
    try:
        reader = PdfReader(BytesIO(data + b"\nstartxref\n0\n%%EOF\n"), strict=False)
    except DependencyError:
        raise _aes_error(display) from None
    except Exception as exc:
        _note_limit(exc, limits)
        raise unreadable() from None
    _unlock(reader, password, display)
    if "/Size" not in reader.trailer:  # the trailer was lost; let pypdf search for the catalog
        numbers = [n for table in reader.xref.values() for n in table] + list(reader.xref_objStm)
        reader.trailer[NameObject("/Size")] = NumberObject(max(numbers, default=0) + 1)
    try:
        slots, declared = _walk_page_tree(reader)
    except DependencyError:
        raise _aes_error(display) from None
    except Exception as exc:
        _note_limit(exc, limits)
        slots, declared = [], 0
    guessed = False
    if not any(slot is not None for slot in slots):
        slots = _scan_page_objects(reader)
        declared, guessed = 0, True
    if not slots:
        raise unreadable()
    return slots, max(declared, len(slots)), guessed


# pypdf raises LimitReachedError both for its resource limits and for some reference cycles; a
# cycle is damage, so only the others count as "exceeds a safety limit".
_CYCLE_WORDS = re.compile(r"cycl|loop|self.reference", re.IGNORECASE)


def _limit_reason(exc: BaseException) -> str | None:
    """pypdf's message when ``exc`` is one of its resource limits, else None."""
    from pypdf.errors import LimitReachedError

    if not isinstance(exc, LimitReachedError) or _CYCLE_WORDS.search(str(exc)):
        return None
    return str(exc).strip() or type(exc).__name__


def _note_limit(exc: BaseException, limits: list[str]) -> None:
    reason = _limit_reason(exc)
    if reason is not None:
        limits.append(reason)


def _limit_detail(reason: str) -> str:
    """Say which of pypdf's limits was hit in words; pypdf's own message otherwise."""
    if "decompress" in reason.lower():
        return "a compressed stream inflates past the reader's decompression limit"
    match = re.search(r"Declared stream length of (\d+)", reason)
    if match:
        return f"a stream declares a length of {int(match.group(1)):,} bytes, over the reader's limit"
    return f"pypdf: {reason}"


def _limit_error(display: str, reason: str) -> DocumentError:
    return DocumentError(
        f"{display} exceeds a safety limit of the PDF reader ({_limit_detail(reason)}), so no text was read; "
        "such limits guard against decompression bombs. If you trust the file, re-export it (for example "
        "print it to a new PDF) or split it, and load that."
    )


def _extract(page: Any, display: str, limits: list[str]) -> str | None:
    """The page's text, or None when it cannot be read (a safety limit is appended to ``limits``)."""
    from pypdf.errors import DependencyError

    if page is None:
        return None
    try:
        if "/Contents" in page:
            # Resolve (and so decrypt) the content stream first: text extraction returns ""
            # without looking at it on pages without fonts, which would hide an AES error.
            _ = page["/Contents"]
        return str(page.extract_text())
    except DependencyError:
        raise _aes_error(display) from None
    except Exception as exc:
        _note_limit(exc, limits)
        return None


def _load_pdf(data: bytes, display: str, password: str | None) -> tuple[list[Page], list[str]]:
    if b"%PDF-" not in data[:1024]:
        raise DocumentError(
            f"{display} is not a valid PDF (no PDF header); check the file or re-export it as PDF."
        )
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    with _quiet_pypdf():
        slots: list[Any] = []
        limits: list[str] = []  # pypdf's safety limits hit while reading, as its messages
        repaired = guessed = False
        expected = 0
        try:
            reader = PdfReader(BytesIO(data), strict=False)
        except DependencyError:
            raise _aes_error(display) from None
        except Exception as exc:
            _note_limit(exc, limits)
            reader = None
        if reader is not None:
            _unlock(reader, password, display)
            try:
                slots = list(reader.pages)
                expected = len(slots)
            except DependencyError:
                raise _aes_error(display) from None
            except Exception as exc:
                _note_limit(exc, limits)
                reader = None
        if reader is None:
            slots, expected, guessed = _open_repaired(data, display, password, limits)
            repaired = True
        raw: list[str | None] = []
        page_limits: dict[int, str] = {}  # page number -> the safety limit its text hit
        for number, page in enumerate(slots, 1):
            before = len(limits)
            raw.append(_extract(page, display, limits))
            if len(limits) > before:
                page_limits[number] = limits[before]
        limited = list(page_limits)

    numbers = list(range(1, len(raw) + 1))
    failed = [n for n, text in zip(numbers, raw, strict=True) if text is None and n not in limited]
    cleaned = clean_text([text or "" for text in raw])
    pages = [Page(number=n, text=t) for n, t in zip(numbers, cleaned, strict=True) if t]
    blank = [n for n, t, r in zip(numbers, cleaned, raw, strict=True) if not t and r is not None]
    missing = list(range(len(raw) + 1, expected + 1))

    if not pages:
        if limits:
            raise _limit_error(display, limits[0])
        if blank and not failed and not missing:
            raise DocumentError(
                f"{display} has no extractable text on any of its {_plural(len(blank), 'page')} "
                f"({_pages_label(blank)}); it looks scanned. Run OCR first "
                f"(e.g. ocrmypdf {display} ocr.pdf) and load the result."
            )
        raise DocumentError(
            f"{display} is damaged and no page with text could be recovered; "
            "get a fresh copy of the file (re-download or re-export it)."
        )

    notes: list[str] = []
    if limited:
        verb = "exceeds" if len(limited) == 1 else "exceed"
        notes.append(
            f"{display}: {_pages_label(limited)} {verb} a safety limit of the PDF reader "
            f"({_limit_detail(page_limits[limited[0]])}); skipped."
        )
    if repaired:
        lost = sorted(set(failed + blank + missing) - set(limited))
        note = (
            f"{display} looks truncated or damaged; recovered text from "
            f"{len(pages)} of {_plural(max(expected, len(raw)), 'page')}"
        )
        if lost:
            note += f"; skipped {_pages_label(lost)} (unreadable or no text)"
        if guessed:
            note += "; page numbers are a best guess"
        notes.append(note + ".")
    else:
        if failed:
            notes.append(
                f"{display}: could not read {_plural(len(failed), 'page')} "
                f"({format_page_ranges(failed)}); they were skipped."
            )
        if blank:
            notes.append(
                f"{display}: no extractable text on {_plural(len(blank), 'page')} "
                f"({format_page_ranges(blank)}); they were skipped (scanned or blank?). "
                "Run OCR (e.g. ocrmypdf) if they matter."
            )
    return pages, notes


__all__ = [
    "Document",
    "Page",
    "clean_text",
    "detect_kind",
    "format_page_ranges",
    "load_document",
    "parse_document",
    "read_source",
    "split_text_pages",
]
