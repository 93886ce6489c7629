"""Cleaning extracted text: one character map (controls, zero-width, odd spaces, ligatures), hyphenation
repair, and paragraphs re-joined from broken lines."""

from __future__ import annotations

import re
from collections import Counter
from itertools import pairwise

__all__ = ["clean_text"]


# Invisible characters no word is spelt with (zero-width space, word joiner, BOM, soft hyphen). The zero-width
# (non-)joiners stay: Persian and Indic words and emoji sequences (a family, a flag) are spelt with them.
_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u2060\ufeff\u00ad"), None)
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


def normalise_whitespace(text: str, keep_indent: bool) -> str:
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


def _reads_as_sentence(line: str) -> bool:
    """Whether a line is a sentence of the body (four words or more, ending as a sentence ends): such a line may
    repeat at a page's edge ("Total for this page: 980 units.", a fact restated) and is never taken for a header."""
    return len(line.split()) >= 4 and line.rstrip("\"'”’)]").endswith((".", "!", "?"))


def _drop_repeated_edges(pages: list[str]) -> list[str]:
    """Remove running headers and footers.

    A first (or last) non-empty line is dropped when the same line, with digits ignored,
    starts (or ends) at least half of the non-empty pages, given at least three of them.
    A page's last remaining line is never dropped, nor a line that reads as a sentence.
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
                    if not _reads_as_sentence(split[i][idx]):
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
    cleaned = [normalise_whitespace(page, keep_indent=not unwrap_lines) for page in pages]
    if drop_headers:
        cleaned = _drop_repeated_edges(cleaned)
    if join_hyphens:
        cleaned = [_join_hyphenated(page) for page in cleaned]
    if unwrap_lines:
        cleaned = [_unwrap(page) for page in cleaned]
    return [page.strip() for page in cleaned]
