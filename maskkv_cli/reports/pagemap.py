"""Which pages of the document the kept prompt entries come from (``maskkv profile``'s page map).

The prompt text is rebuilt with the chat template and tokenized again with character offsets (a fast tokenizer;
the ids must equal the ones the run used). The document's text is found inside the prompt; each prompt token
whose characters lie in it gets the page of its first such character (``Document.page_at``). When the middle
of a long document was cut to fit the window, the kept head and tail are aligned with the document's start and
end, so only what is in the prompt is mapped. Every other token (chat template, question, the cut marker)
counts as "question/template".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from maskkv_cli.documents import Document
from maskkv_cli.engine.selection import LayerRecord

OUTSIDE = "question/template"


@dataclass(frozen=True)
class PageCount:
    page: int
    tokens: int  # prompt tokens of this page
    kept: int  # kept prompt entries (over layers, heads and batch) of these tokens
    slots: int  # the most there could be: tokens x layers x heads x batch

    @property
    def share(self) -> float:
        return self.kept / self.slots if self.slots else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"page": self.page, "tokens": self.tokens, "kept": self.kept, "share": self.share}


@dataclass(frozen=True)
class PageMap:
    """Kept prompt entries per document page, and outside the document (template and question)."""

    pages: tuple[PageCount, ...]
    outside: PageCount  # ``page`` 0: the chat template, the question, a cut marker
    dropped_tokens: int = 0  # document tokens cut from the middle (not in the prompt)
    note: str | None = None

    @property
    def kept_total(self) -> int:
        return sum(p.kept for p in self.pages) + self.outside.kept

    def as_dict(self) -> dict[str, Any]:
        return {"mapped": True, "pages": [p.as_dict() for p in self.pages],
                OUTSIDE: {k: v for k, v in self.outside.as_dict().items() if k != "page"},
                "kept_total": self.kept_total, "dropped_tokens": self.dropped_tokens, "note": self.note}


def kept_position_counts(records: Sequence[LayerRecord], prompt_len: int) -> list[int]:
    """How many (layer, head, batch row) slots keep each prompt position; ``prompt_len`` counts.

    Only the first ``head_budgets[b, h]`` entries of ``positions[b, h]`` are real (the rest pad a ragged
    layer); a record without positions kept every prompt position in every head.
    """
    counts = torch.zeros(prompt_len, dtype=torch.int64)
    for rec in records:
        lengths = rec.head_budgets.to(torch.int64)  # (B, H)
        if rec.positions is None:  # a dense layer: every head holds the whole prompt
            counts += lengths.numel()
            continue
        pos: Tensor = rec.positions.to(torch.int64)  # (B, H, K)
        valid = torch.arange(pos.shape[-1])[None, None, :] < lengths[..., None]
        counts += torch.bincount(pos[valid].clamp(0, prompt_len - 1), minlength=prompt_len)[:prompt_len]
    return counts.tolist()


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search on slice equality: fast in C for long texts
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def token_pages(
    doc: Document, context: str, text: str, offsets: Sequence[tuple[int, int]], start: int | None = None
) -> tuple[list[int | None], str | None]:
    """The document page of every prompt token (None: outside the document), and a note when partial.

    ``context`` is the document text as it went into the prompt (all of ``doc.text``, or its start and end
    around a cut), ``text`` the whole prompt text and ``offsets`` each token's ``(start, end)`` in ``text``.
    ``start``: where the stripped context begins in ``text`` when known (default: its first occurrence).
    """
    ctx = context.strip()
    if start is None or text[start : start + len(ctx)] != ctx:
        start = text.find(ctx) if ctx else -1
    if start < 0:
        return [None] * len(offsets), "the document's text was not found in the prompt; nothing mapped to pages"
    full = doc.text
    lead = len(full) - len(full.lstrip())
    body = full.strip()
    head = _common_prefix(ctx, body)
    tail = 0 if head == len(ctx) else _common_suffix(ctx, body, min(len(ctx), len(body)) - head)
    cut_from, cut_to = head, len(ctx) - tail  # ctx[cut_from:cut_to] is not in the document (cut marker)

    def doc_offset(i: int) -> int | None:  # i: a character index of ctx
        if i < cut_from:
            return lead + i
        if i >= cut_to:
            return lead + len(body) - (len(ctx) - i)
        return None

    pages: list[int | None] = []
    end_ctx = start + len(ctx)
    for a, b in offsets:
        page = None
        for c in range(max(a, start), min(max(b, a + 1), end_ctx)):
            off = doc_offset(c - start)
            if off is not None:
                page = doc.page_at(off)
                break
        pages.append(page)
    note = None
    if cut_to > cut_from and head + tail < len(body):
        note = (f"the middle of the document was cut to fit the window: only its first {head} and last {tail} "
                f"characters are in the prompt and mapped")
    return pages, note


def page_map(
    counts: Sequence[int],
    pages_of_tokens: Sequence[int | None],
    page_numbers: Sequence[int],
    slots_per_token: int,
    dropped_tokens: int = 0,
    note: str | None = None,
) -> PageMap:
    """Sum kept counts per page. ``counts[i]``: kept slots of prompt token i; ``pages_of_tokens[i]``: its page."""
    if len(counts) != len(pages_of_tokens):
        raise ValueError(f"{len(counts)} counts for {len(pages_of_tokens)} tokens")
    kept = dict.fromkeys(page_numbers, 0)
    tokens = dict.fromkeys(page_numbers, 0)
    out_kept = out_tokens = 0
    for n, page in zip(counts, pages_of_tokens, strict=True):
        if page is None or page not in kept:
            out_kept += n
            out_tokens += 1
        else:
            kept[page] += n
            tokens[page] += 1
    rows = tuple(PageCount(p, tokens[p], kept[p], tokens[p] * slots_per_token) for p in page_numbers)
    return PageMap(rows, PageCount(0, out_tokens, out_kept, out_tokens * slots_per_token), dropped_tokens, note)


def prompt_text(tokenizer: Any, user_text: str) -> str:
    """The chat-template text whose tokens are ``prompting.chat_prompt_ids(tokenizer, user_text)``."""
    from maskkv_cli.prompting import llada_template

    messages = [{"role": "user", "content": user_text}]
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return llada_template(messages)


def map_pages(
    tokenizer: Any,
    doc: Document,
    context: str,
    question: str,
    records: Sequence[LayerRecord],
    prompt_len: int,
    dropped_tokens: int = 0,
) -> PageMap | str:
    """The page map of one run, or the reason it cannot be made (a one-line string)."""
    from maskkv_cli.prompting import chat_prompt_ids, document_question

    if not records:
        return "this policy keeps no prompt cache"
    user = document_question(context, question)
    text = prompt_text(tokenizer, user)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError) as exc:
        return f"the tokenizer gives no character offsets ({type(exc).__name__}); a fast tokenizer is needed"
    ids = list(enc["input_ids"])
    if len(ids) != prompt_len or ids != chat_prompt_ids(tokenizer, user):
        return "the prompt could not be tokenized again exactly; kept positions not mapped to pages"
    at = text.find(user.strip())  # the whole user message is unique; the template around it is not searched
    pages, note = token_pages(doc, context, text, [tuple(o) for o in enc["offset_mapping"]], at if at >= 0 else None)
    b, h = records[0].head_budgets.shape
    counts = kept_position_counts(records, prompt_len)
    return page_map(counts, pages, [p.number for p in doc.pages], len(records) * h * b, dropped_tokens, note)


def group_pages(pages: Sequence[PageCount], max_rows: int) -> list[tuple[str, PageCount]]:
    """At most ``max_rows`` (label, counts) rows: consecutive pages merged into equal ranges when there are more."""
    if max_rows <= 0:
        raise ValueError("max_rows must be positive")
    if len(pages) <= max_rows:
        return [(str(p.page), p) for p in pages]
    size = -(-len(pages) // max_rows)
    rows: list[tuple[str, PageCount]] = []
    for i in range(0, len(pages), size):
        chunk = pages[i : i + size]
        first, last = chunk[0].page, chunk[-1].page
        label = str(first) if first == last else f"{first}-{last}"
        rows.append((label, PageCount(first, sum(p.tokens for p in chunk), sum(p.kept for p in chunk),
                                      sum(p.slots for p in chunk))))
    return rows
