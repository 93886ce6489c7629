"""Whether a page's text can be read: the share of its characters that no reader can make sense of.

A PDF whose fonts are lost (a truncated download keeps the pages' content streams but not the fonts at the end of
the file) or map their glyphs to the Unicode private-use area extracts as runs of U+FFFD or private-use characters:
text of the right shape that says nothing. ``screen_pages`` measures each page and drops the pages over
``UNREADABLE_PAGE``, with a note naming them; a document whose pages are mostly unreadable fails with one line.

The threshold was chosen on the damaged-PDF corpus the tests build (``tests/pdfs.py`` ``text_layer_corpus``, seed
1) and confirmed on a second one (seed 2) and on truncated copies of real PDFs (``scripts/text_layer_threshold.py``;
the evidence is in ``docs/evaluation.md``, "Damaged text layers").
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

from maskkv_cli.documents.model import Page, pages_label
from maskkv_cli.errors import DocumentError

__all__ = ["UNREADABLE_PAGE", "screen_pages", "unreadable_share"]

# A page is dropped when more than this share of its non-space characters is unreadable. On the choice corpus
# (seed 1) clean pages scored at most 0.130 (a short list whose bullets are unmapped glyphs) and damaged pages at
# least 0.975 (a broken body font under an intact page number); the cut is the middle of that gap, rounded down to
# 0.05. A page with half of its lines in a lost font scores about 0.54, so it is kept (3 of 12 were dropped).
UNREADABLE_PAGE = 0.55
# A document fails when more than this share of its pages is unreadable ("mostly garbage").
UNREADABLE_DOCUMENT = 0.5

# Unicode categories no text carries on purpose: private use, unassigned, surrogates, controls.
_UNREADABLE_CATEGORIES = frozenset({"Co", "Cn", "Cs", "Cc"})


def _unreadable(ch: str) -> bool:
    return ch == "\ufffd" or unicodedata.category(ch) in _UNREADABLE_CATEGORIES


def unreadable_share(text: str) -> float:
    """The share of ``text``'s non-space characters that are U+FFFD, private-use, unassigned, surrogate or control
    characters (0.0 for a text with no such character, or no character at all)."""
    total = bad = 0
    for ch in text:
        if ch.isspace():
            continue
        total += 1
        bad += _unreadable(ch)
    return bad / total if total else 0.0


def screen_pages(pages: Sequence[Page], display: str) -> tuple[list[Page], list[str]]:
    """The readable pages and a note naming the dropped ones (none when every page reads); raises DocumentError
    ("the text layer is damaged: N of M pages unreadable") when more than half of the pages are unreadable."""
    shares = {page.number: unreadable_share(page.text) for page in pages}
    dropped = [n for n, share in shares.items() if share > UNREADABLE_PAGE]
    if not dropped:
        return list(pages), []
    worst = min(shares[n] for n in dropped)
    amount = "all" if worst == 1.0 else f"{int(100 * worst)}% or more"
    why = (f"{amount} of {'its' if len(dropped) == 1 else 'their'} characters are U+FFFD or private-use: fonts "
           "missing or without a Unicode map")
    if len(dropped) > UNREADABLE_DOCUMENT * len(pages):
        raise DocumentError(
            f"{display}: the text layer is damaged: {len(dropped)} of {len(pages)} pages unreadable "
            f"({pages_label(dropped)}: {why}); get a fresh copy of the file (it may be truncated), or run OCR "
            f"(e.g. ocrmypdf --force-ocr {display} ocr.pdf) and load the result."
        )
    kept = [page for page in pages if page.number not in dropped]
    return kept, [f"{display}: skipped {pages_label(dropped)} of {len(pages)}: the text layer is damaged ({why})."]
