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
        if n > max_tokens:  # one long page: cut it into pieces that fit
            parts.extend(Part(page.number, page.number, piece, k) for piece, k in pieces(page.text, count, max_tokens))
            continue
        if not cur:
            first = page.number
        cur.append(page.text)
        cur_tokens += n
        last = page.number
    if cur:
        parts.append(Part(first, last, "\n\n".join(cur), cur_tokens))
    return parts


def pieces(text: str, count: Callable[[str], int], max_tokens: int) -> list[tuple[str, int]]:
    """``text`` cut into consecutive pieces of at most ``max_tokens`` each (by ``count``), with their counts: at
    words, in runs of as many words as the text's density gives; a run denser than that is cut again; a text without
    spaces (Chinese, Japanese, one long token run) at characters. Only a single character longer than the limit
    stays longer. Neighbouring pieces that fit together are joined (a page of long runs without spaces and a few
    words between them made the words pieces of one or two words each)."""
    words = text.split()
    units, sep = (words, " ") if len(words) > 1 else (list(text.strip()), "")
    step = max(1, len(units) * max_tokens // max(1, count(text)))
    out: list[tuple[str, int]] = []
    for i in range(0, len(units), step):
        piece = sep.join(units[i : i + step])
        k = count(piece)
        if k > max_tokens and (step > 1 or sep == " "):  # denser than the text on average, or one long word
            out.extend(pieces(piece, count, max_tokens))
        else:
            out.append((piece, k))
    return _joined(out, sep, count, max_tokens)


def _joined(out: list[tuple[str, int]], sep: str, count: Callable[[str], int],
            max_tokens: int) -> list[tuple[str, int]]:
    """``out`` with each piece joined to the one before while both together fit ``max_tokens``."""
    packed: list[tuple[str, int]] = []
    for piece, k in out:
        if packed and packed[-1][1] + k <= max_tokens:
            joined = f"{packed[-1][0]}{sep}{piece}"
            n = count(joined)
            if n <= max_tokens:
                packed[-1] = (joined, n)
                continue
        packed.append((piece, k))
    return packed


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


# Tokens per word of English summaries, to turn ``--length`` words into the final pass's token budget.
TOKENS_PER_WORD = 1.6


def summary_tokens(words: int, block: int) -> int:
    """The token budget of a summary of about ``words`` words: a whole number of ``block``-token blocks."""
    return max(block, -(-int(words * TOKENS_PER_WORD) // block) * block)


def _vocabulary(text: str) -> set[str]:
    return {w.strip(".,;:!?\"'()[]").casefold() for w in text.split()}


def trim_summary(text: str, words: int | None, source: str, ran_out: bool) -> str:
    """``text`` at most ``words`` words long (None: any), never ending inside a word: a last word that the token
    budget cut (``ran_out``: the answer used every token) or that is only the start of a word of ``source`` is
    dropped, and a cut keeps whole sentences when one ends in the second half of what is kept."""
    kept = text.split()
    known = _vocabulary(source)
    last = kept[-1].strip(".,;:!?\"'()[]").casefold() if kept else ""
    cut_word = ran_out and not kept[-1].endswith((".", "!", "?")) if kept else False
    prefix_only = bool(last) and last not in known and any(w.startswith(last) and w != last for w in known)
    if cut_word or prefix_only:
        kept = kept[:-1]
    if words is not None and len(kept) > words:
        kept = kept[:words]
        ends = [i for i, w in enumerate(kept) if w.endswith((".", "!", "?"))]
        if ends and ends[-1] + 1 >= len(kept) // 2:
            kept = kept[: ends[-1] + 1]
    return " ".join(kept)


def adds_nothing(final: str, summaries: list[str]) -> bool:
    """Whether a final summary only repeats the parts' summaries (its text is found in theirs, as the lead of the
    joined leads is): then the parts' summaries say more than it."""
    flat = " ".join(final.split()).casefold()
    return bool(flat) and flat in " ".join(" ".join(summaries).split()).casefold()
