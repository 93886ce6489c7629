"""Text and Markdown files: decoding (UTF-8, UTF-16, legacy code pages), and pages cut at blank lines, not inside
a Markdown code fence unless the fenced block alone is longer than a page."""

from __future__ import annotations

import codecs
import re

from maskkv_cli.documents.clean import clean_text, normalise_whitespace
from maskkv_cli.documents.model import Page
from maskkv_cli.errors import DocumentError

TEXT_PAGE_CHARS = 3000  # target size of a "page" of a text file without form feeds
# the most characters between two form feeds that are read as a page (pdftotext's pages hold a few thousand): one
# form feed after megabytes of text does not make them one page
FORM_FEED_PAGE_CHARS = 10 * TEXT_PAGE_CHARS

__all__ = ["TEXT_PAGE_CHARS", "load_text", "split_text_pages"]


_BINARY_CONTROLS = bytes(c for c in range(32) if c not in (9, 10, 11, 12, 13, 27)) + b"\x7f"
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def _looks_binary(data: bytes) -> bool:
    """More than 5% of the first 64 KiB are NUL or other control bytes (a stray NUL in a text is dropped later)."""
    sample = data[: 1 << 16]
    controls = len(sample) - len(sample.translate(None, _BINARY_CONTROLS))
    return controls > 0.05 * len(sample)


def _utf16_without_marker(data: bytes) -> tuple[str, str] | None:
    """(the UTF-16 variant, the text) of text saved without its byte-order marker, told by its NUL bytes (the high
    byte of every Latin character) all on one side of each pair; None when it does not read so."""
    sample = data[: 1 << 16]
    if len(data) % 2 or len(sample) < 4:
        return None
    even, odd = sample[0::2], sample[1::2]
    for encoding, zeros, other in (("utf-16-le", odd, even), ("utf-16-be", even, odd)):
        if zeros.count(0) >= 0.3 * len(zeros) and other.count(0) <= 0.02 * len(other):
            try:
                text = data.decode(encoding)
            except UnicodeDecodeError:
                continue
            if _mostly_printable(text):
                return encoding, text
    return None


def _mostly_printable(text: str) -> bool:
    sample = text[: 1 << 16]
    if not sample:
        return True
    good = sum(1 for ch in sample if ch.isprintable() or ch in "\n\t\r\f\v")
    return good >= 0.97 * len(sample)


def decode_text(data: bytes, display: str) -> tuple[str, list[str]]:
    """The text of a file's bytes: UTF-8 (with or without its marker), UTF-16 with its marker, else Windows-1252 or
    Latin-1 with a note saying so; binary data and undecodable text are a ``DocumentError``."""
    notes: list[str] = []
    # UTF-32's marker first: it starts as UTF-16's does
    for codec, markers in (("UTF-32", (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)),
                           ("UTF-16", (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))):
        if data.startswith(markers):
            try:
                text = data.decode(codec.lower())
            except UnicodeDecodeError:
                raise DocumentError(f"{display} starts with a {codec} marker but is not valid {codec}; re-save it as "
                                    "UTF-8 and try again.") from None
            if not _mostly_printable(text):
                raise DocumentError(f"{display} looks binary, not text; pass a text, Markdown or PDF file.")
            return text, notes
    if data.startswith(codecs.BOM_UTF8):
        text = data.decode("utf-8-sig", errors="replace")
        if "\ufffd" in text and "\ufffd".encode() not in data:
            notes.append(f"{display} has bytes that are not valid UTF-8; they were replaced with '\ufffd'.")
        return text, notes
    wide = _utf16_without_marker(data)
    if wide is not None:
        notes.append(f"{display} has no byte-order mark; it was read as {wide[0].upper()}. Convert it to UTF-8 if "
                     "some characters look wrong.")
        return wide[1], notes
    if _looks_binary(data):
        raise DocumentError(
            f"{display} looks binary (it contains NUL or control bytes), not text; pass a text, Markdown or PDF "
            "file (text in another encoding: convert it to UTF-8 first, e.g. with iconv)."
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


def load_text(data: bytes, display: str, kind: str) -> tuple[list[Page], list[str]]:
    text, notes = decode_text(data, display)
    if not text.strip():
        raise DocumentError(f"{display} contains only whitespace; pass a file that contains text.")
    pieces = text.split("\f")
    longest = max(len(piece) for piece in pieces)
    form_feeds = len(pieces) > 1 and longest <= FORM_FEED_PAGE_CHARS
    if form_feeds:
        raw_pages = pieces
    else:
        if len(pieces) > 1:
            notes.append(f"{display}: its form feeds are no page breaks (the text between two is {longest} "
                         f"characters long): cut into pages of about {TEXT_PAGE_CHARS} characters instead")
        raw_pages = split_text_pages(normalise_whitespace(text.replace("\f", "\n\n"), keep_indent=True), kind)
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
