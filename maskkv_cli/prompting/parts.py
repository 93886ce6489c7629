"""Summaries of documents far longer than the window: summarize parts, then the summaries."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from maskkv_cli.documents import Document


@dataclass(frozen=True)
class Part:
    first_page: int
    last_page: int
    text: str
    tokens: int


def split_parts(doc: Document, count: Callable[[str], int], max_tokens: int) -> list[Part]:
    """Group whole pages into parts of at most ``max_tokens``; a page longer than that is cut into pieces."""
    parts: list[Part] = []
    cur: list[str] = []
    cur_tokens = 0
    first = last = 0
    for page in doc.pages:
        n = count(page.text)
        if cur and cur_tokens + n > max_tokens:
            parts.append(Part(first, last, "\n\n".join(cur), cur_tokens))
            cur, cur_tokens = [], 0
        if n > max_tokens:  # one long page: cut it by words
            words = page.text.split()
            step = max(1, len(words) * max_tokens // max(1, n))
            for i in range(0, len(words), step):
                piece = " ".join(words[i:i + step])
                parts.append(Part(page.number, page.number, piece, count(piece)))
            continue
        if not cur:
            first = page.number
        cur.append(page.text)
        cur_tokens += n
        last = page.number
    if cur:
        parts.append(Part(first, last, "\n\n".join(cur), cur_tokens))
    return parts


# A lead summary (what the embedded model is trained to write for ``part_instruction``): the first sentences of
# the text, as the LEAD baseline of news summarization.
LEAD_SENTENCES = 3
# Tokens of a lead summary for a model whose generation_config.json does not say (``summary_length``).
SUMMARY_TOKENS = 64
# Word counts the embedded model saw in ``part_instruction`` during training (``summarize --length``).
SUMMARY_WORDS: tuple[int, ...] = (30, 50, 75, 100, 150, 200, 300)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[`])")


def lead_sentences(text: str, n: int = LEAD_SENTENCES) -> list[str]:
    """The first ``n`` sentences of ``text`` (whitespace collapsed; a sentence ends at . ! or ? before a capital
    letter, digit, quote or bracket)."""
    flat = " ".join(text.split())
    if not flat:
        return []
    return [s for s in _SENTENCE_END.split(flat, maxsplit=n)[:n] if s]


def part_instruction(words: int) -> str:
    return f"Summarize the text above in about {words} words."


def merge_instruction(words: int) -> str:
    return f"The text above is a list of summaries of consecutive parts of one document. Write one summary of " \
           f"the whole document in about {words} words."
