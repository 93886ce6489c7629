"""A document as maskkv holds it: ``Document`` (its pages of cleaned text, where it came from, what went wrong
while reading it) and ``Page``, and how page numbers are written in messages.

Every reader (``pdf.py``, ``text.py``) builds pages of this model and ``reading.py`` assembles the document; the
model imports no reader.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "PAGE_SEPARATOR", "Document", "Page", "format_page_ranges", "pages_label", "plural"]

KINDS = ("pdf", "text", "markdown")
PAGE_SEPARATOR = "\n\n"


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


def plural(n: int, word: str) -> str:
    """``plural(1, "page")`` -> ``"1 page"``; ``plural(3, "page")`` -> ``"3 pages"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def pages_label(numbers: list[int]) -> str:
    """``[5]`` -> ``"page 5"``; ``[4, 5]`` -> ``"pages 4-5"``."""
    return ("page " if len(set(numbers)) == 1 else "pages ") + format_page_ranges(numbers)
