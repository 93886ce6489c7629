"""The core use case: a question about a text becomes an answer.

``ask`` fits the text to the model's window and runs the sampler with the chosen cache policy. A text longer than
the window is, by default, read in parts (``--long parts``): overlapping windows of it, each asked the question
(the text encoded once), the answer taken from the part(s) that answer with the highest confidence, "not in the
document" only when every part says so. It can instead be cut in the middle (``truncate``) or kept whole under
scaled RoPE (``rope-scale``). ``ask``, ``summarize``, ``profile``, ``demo``, ``batch`` and ``bench quality`` all
go through here; ``prepare`` is the one-prompt half on its own, for callers that build a prompt once and answer it
under several cache settings.

Every answer records what was read (``Answer.fitted``: the characters of the text the model saw, the part(s) the
answer came from), and ``answer_row`` says what kind of statement it is (``claim``): an answer, "not in the
document" as a finding, or an absence that holds only for what was read or for a model not shown to say it
reliably.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from maskkv_cli.app import arguments
from maskkv_cli.app.session import Answer, Session
from maskkv_cli.engine.plan import CacheConfig
from maskkv_cli.errors import UsageError
from maskkv_cli.models.families import family
from maskkv_cli.prompting import NO_ANSWER, document_question, stop_ids
from maskkv_cli.prompting.fit import (
    DEFAULT_LONG,
    PART_OVERLAP,
    FittedContext,
    Span,
    char_offsets,
    fit_context,
    part_windows,
)
from maskkv_cli.runtime.stats import RunStats
from maskkv_cli.sampling import Event, GenerationConfig
from maskkv_cli.sampling.confidence import LOW_CONFIDENCE_STATISTIC, Confidence

__all__ = ["CLAIMS", "MIN_PART_ROOM", "Answer", "PartsAnswer", "Prompt", "Session", "add_pages", "answer_row", "ask",
           "ask_in_parts", "ask_many", "batch_size_for", "choose_part", "claim", "common_source", "confidence_fields",
           "no_room", "one_prompt", "part_prompts", "parts_answer", "parts_stats", "prepare", "prompt_lengths",
           "reading_fields", "room_for_text", "room_needed", "says_absent", "spans_pages", "trained_question",
           "used_every_token"]


@dataclass(frozen=True)
class Prompt:
    """The prompt ids of one question about a text, and how the text was fitted to the window."""

    ids: list[int]
    fitted: FittedContext
    # leading ids that are the template's start and the document, whatever the question (computed for the families
    # that compute a document's prefix once: LLaDA2's blocks, ``engine/prefix.py``, DiffusionGemma's encoder
    # cache, ``sampling/diffusion_gemma.py``); 0: unknown
    document_len: int = 0


@dataclass
class PartsAnswer(Answer):
    """An answer read from a text in parts: the chosen answer, and every part's own answer in text order."""

    parts: list[Answer] = field(default_factory=list)


# The fewest tokens of text a part of a document read in parts may hold: below it a long answer beside a short window
# reads a text in dozens to hundreds of parts of a few tokens each (an answer of 200 tokens on a 256-token window:
# 66 prompts for a text of 1,120 tokens), each too short to hold a fact. ``summarize`` holds its parts to it too.
MIN_PART_ROOM = 64


def room_for_text(session: Session, question: str, gen_length: int) -> int:
    """Tokens of text one prompt holds beside the chat template, the question and ``gen_length`` answer tokens (as
    many positions as the sampler's response takes: ``Session.response_positions``)."""
    return session.window - session.prompt_overhead(question) - session.response_positions(gen_length)


def room_needed(session: Session, question: str, gen_length: int) -> int:
    """``room_for_text``, refused in one line when it is not positive (``no_room``)."""
    room = room_for_text(session, question, gen_length)
    if room <= 0:
        raise no_room(session, question, gen_length)
    return room


def no_room(session: Session, question: str, gen_length: int) -> UsageError:
    """The error of an answer that leaves the document no room: the answer's length and the prompt around the
    document are named, with the longest answer that leaves the document a token."""
    overhead, window = session.prompt_overhead(question), session.window
    answer = session.response_positions(gen_length)
    longest = session.longest_answer(window - overhead - 1)  # answer positions that leave the document a token
    hint = f"ask for at most {longest} new tokens" if longest > 0 else "shorten the question"
    return UsageError(f"an answer of {answer} tokens and the prompt around the document ({overhead} tokens: chat "
                      f"template and question) take {answer + overhead} of the model's {window}-token window, "
                      f"leaving no room for the document: {hint}")


def prepare(session: Session, context: str, question: str, gen_length: int, long: str = "truncate") -> Prompt:
    """Fit ``context`` into what the window leaves beside the question and ``gen_length`` response tokens, and
    build the chat prompt of document then question. ``long``: ``truncate`` or ``rope-scale`` (one prompt; a text
    that fits is the same under every mode).

    The room is the window less the prompt of an empty document and the response, but the prompt holding the text
    can take a few tokens more than the two counted apart: tokens merge differently where the text meets the
    question, a cut text carries its ``...`` marker, and a decoded cut re-encodes longer where it split a
    character. Such a prompt is fitted again to the room less the excess, so that no prompt runs past the window."""
    cfg = session.model.config
    overhead = session.prompt_overhead(question)
    response = session.response_positions(gen_length)
    room = session.window - overhead - response
    if long != "rope-scale" and room <= 0:  # a cut needs room; RoPE scaling sizes itself for the whole sequence
        raise no_room(session, question, gen_length)
    doc_ids = session.document_ids(context)  # encoded once per document, whatever the number of questions
    # RoPE scaling sizes its factor for the whole sequence; a cut needs only the room.
    total = overhead + len(doc_ids) + response if long == "rope-scale" else None
    limit = overhead + room  # the tokens the prompt may take
    while True:
        fitted = fit_context(session.tokenizer, context, room, long, cfg.head_dim, session.base_theta,
                             session.window, total, doc_ids)
        ids = session.prompt_ids(document_question(fitted.text, question))
        over = len(ids) - limit
        if over <= 0 or fitted.mode == "rope-scale":  # (kept whole under RoPE scaling: past the window by design)
            break
        room -= over  # fitted again to the room less what the prompt took beyond it
        if room <= 0:
            raise no_room(session, question, gen_length)
    shares = family(cfg.family).document_prefix  # the family computes a document's prefix once for its questions
    document_len = session.document_prompt_len(fitted.text, ids) if shares else 0
    return Prompt(ids, fitted, document_len)


def ask(
    session: Session,
    context: str,
    question: str,
    gen: GenerationConfig,
    cache: CacheConfig,
    *,
    long: str = DEFAULT_LONG,
    on_event: Callable[[Event], None] | None = None,
    on_prompt: Callable[[Prompt], None] | None = None,
    on_part: Callable[[int, int], None] | None = None,
) -> Answer:
    """Answer ``question`` about ``context``: fit, prompt, sample. ``on_prompt`` sees each prompt before its
    prefill starts; ``on_event`` gets the sampler's progress; ``on_part(i, n)`` is told when part ``i`` of ``n``
    starts (a text read in parts). The answer carries the fitted context and what was read."""
    arguments.question_arguments("ask", gen, cache, [(context, question)])
    prompt = one_prompt(session, context, question, gen.gen_length, long)
    if prompt is None:
        return ask_in_parts(session, context, session.document_ids(context),
                            room_needed(session, question, gen.gen_length), question, gen, cache, on_event=on_event,
                            on_prompt=on_prompt, on_part=on_part)
    if on_prompt is not None:
        on_prompt(prompt)
    answer = session.answer_ids(prompt.ids, gen, cache, on_event, document_len=prompt.document_len,
                                rope_factor=prompt.fitted.rope_factor)
    return replace(answer, fitted=prompt.fitted)


def one_prompt(session: Session, context: str, question: str, gen_length: int, long: str) -> Prompt | None:
    """The one prompt of ``question`` about ``context`` under ``long`` (``prepare``), or None where ``long`` is
    ``parts`` and the text does not fit the window whole: it is read in parts then, never cut (a text whose count
    fits but whose joined prompt runs past the window included), each part at least ``MIN_PART_ROOM`` tokens."""
    if long != "parts":
        return prepare(session, context, question, gen_length, long)
    room = room_needed(session, question, gen_length)
    if len(session.document_ids(context)) <= room:
        prompt = prepare(session, context, question, gen_length, "truncate")  # the one prompt every mode builds
        if not prompt.fitted.dropped:
            return prompt
    if room < MIN_PART_ROOM:
        overhead, window = session.prompt_overhead(question), session.window
        longest = session.longest_answer(window - overhead - MIN_PART_ROOM)
        hint = f"ask for at most {longest} new tokens" if longest > 0 else "shorten the question"
        raise UsageError(f"an answer of {session.response_positions(gen_length)} tokens and the prompt around the "
                         f"document ({overhead} tokens) leave {room} tokens of the model's {window}-token window for "
                         f"each part of the document, too few to read it in parts (at least {MIN_PART_ROOM}): "
                         f"{hint}, or give --long truncate")
    return None


def ask_in_parts(
    session: Session,
    context: str,
    ids: Sequence[int],
    room: int,
    question: str,
    gen: GenerationConfig,
    cache: CacheConfig,
    *,
    overlap: int = PART_OVERLAP,
    on_event: Callable[[Event], None] | None = None,
    on_prompt: Callable[[Prompt], None] | None = None,
    on_part: Callable[[int, int], None] | None = None,
) -> PartsAnswer:
    """Ask ``question`` of every window of ``room`` tokens of ``context`` (token ``ids``), each sharing ``overlap``
    tokens (at most a quarter of the room) with the next, and answer from the part(s) ``choose_part`` picks."""
    prompts, room = part_prompts(session, context, ids, room, question, overlap)
    answers: list[Answer] = []
    for i, prompt in enumerate(prompts, 1):
        if on_part is not None:
            on_part(i, len(prompts))
        if on_prompt is not None:
            on_prompt(prompt)
        answers.append(replace(session.answer_ids(prompt.ids, gen, cache, on_event), fitted=prompt.fitted))
    return parts_answer(context, len(ids), room, answers, overlap)


def part_prompts(session: Session, context: str, ids: Sequence[int], room: int, question: str,
                 overlap: int = PART_OVERLAP) -> tuple[list[Prompt], int]:
    """The prompts of ``question`` about each window of ``room`` tokens of ``context`` (token ``ids``), each window
    sharing ``overlap`` tokens (at most a quarter of the room) with the next, in text order; and the room they were
    made with: ``room``, or less where a prompt took more than ``room`` tokens beside the question (as ``prepare``
    says why): the windows are laid out again over that much less, until every prompt fits."""
    limit = session.prompt_overhead(question) + room  # the tokens each prompt may take
    while True:
        prompts = _part_prompts(session, context, ids, room, question, overlap)
        over = max(len(p.ids) for p in prompts) - limit
        if over <= 0:
            return prompts, room
        room -= over  # (part_windows refuses a room used up)


def _part_prompts(session: Session, context: str, ids: Sequence[int], room: int, question: str,
                  overlap: int) -> list[Prompt]:
    """``part_prompts``' prompts of windows of ``room`` tokens, however long each prompt comes out."""
    windows = part_windows(len(ids), room, min(overlap, room // 4))
    chars = len(context)
    bounds = sorted({at for window in windows for at in window if at < len(ids)})
    offset = dict(zip(bounds, char_offsets(session.tokenizer, ids, bounds, context), strict=True))
    offset[len(ids)] = chars
    prompts = []
    for start, end in windows:
        text = session.tokenizer.decode(list(ids[start:end]))
        span = (offset[start], offset[end])
        fitted = FittedContext(text, end - start, 0, 1, "", (span,), chars, source=(span,), mode="parts")
        prompts.append(Prompt(session.prompt_ids(document_question(text, question)), fitted))
    return prompts


def parts_answer(context: str, n_tokens: int, room: int, answers: Sequence[Answer],
                 overlap: int = PART_OVERLAP) -> PartsAnswer:
    """The answer to a question read in parts, from its parts' answers in text order (each with its ``fitted``)."""
    chosen, source = choose_part(answers)
    windows = part_windows(n_tokens, room, min(overlap, room // 4))
    shared = windows[0][1] - windows[1][0] if len(windows) > 1 else 0
    rule = (f"document is {n_tokens} tokens, longer than the {room} the window leaves: read in {len(answers)} parts "
            f"of up to {room} tokens, each sharing {shared} with the next")
    fitted = replace(chosen.fitted, rule=rule, read=((0, len(context)),), parts=len(answers),
                     source=common_source([a.fitted.source[0] for a in source]))  # type: ignore[union-attr]
    notes = list(dict.fromkeys(n for a in answers for n in a.notes))
    stats = parts_stats([a.result.stats for a in answers])
    return PartsAnswer(chosen.text, sum(a.prompt_len for a in answers), chosen.budget,
                       replace(chosen.result, stats=stats), notes, chosen.confidence, fitted, parts=list(answers))


def prompt_lengths(session: Session, context: str, question: str, gen_length: int,
                   long: str = DEFAULT_LONG) -> list[tuple[int, int]]:
    """About how many tokens each prompt ``ask`` builds for ``question`` about ``context`` holds, and how many of
    them are the document's: its parts (each taken as long as the room), else the one prompt (the text cut to the
    room unless RoPE-scaled)."""
    n_ids = len(session.document_ids(context))
    overhead = session.prompt_overhead(question)
    room = room_for_text(session, question, gen_length)
    if long == "parts" and n_ids > room:
        return [(overhead + room, room)] * len(part_windows(n_ids, room, min(PART_OVERLAP, room // 4)))
    text = n_ids if long == "rope-scale" else min(n_ids, room)
    return [(overhead + text, text)]


def batch_size_for(session: Session, items: Sequence[tuple[str, str]], gen: GenerationConfig, cache: CacheConfig,
                   long: str, requested: int | None) -> tuple[int, str | None]:
    """How many prompts ``ask_many`` denoises together for these ``(context, question)`` items: ``requested``, or
    for None the most of their prompts (each part counted, each taken as long as the window) that fit by the memory
    model, unless a batch would share too little of the rows their prefills and steps run (a stored document
    prefix's rows not counted: ``Session.prefix_rows``; ``Session.batch_size``), with the line saying so."""
    if requested is not None:  # a size given: nothing to measure
        return requested, None
    prompts = [p for context, question in items for p in prompt_lengths(session, context, question,
                                                                         gen.gen_length, long)]
    work = [n - session.prefix_rows(doc, n, gen, cache) for n, doc in prompts]
    return session.batch_size(requested, [session.window] * len(prompts), gen, cache, work_lens=work)


def ask_many(
    session: Session,
    items: Sequence[tuple[str, str]],
    gen: GenerationConfig,
    cache: CacheConfig,
    *,
    long: str = DEFAULT_LONG,
    batch_size: int = 1,
    on_answer: Callable[[int, Answer], None] | None = None,
) -> list[Answer]:
    """Answer each ``(context, question)`` as ``ask`` does, every prompt of every question (each part of a text
    read in parts) denoised up to ``batch_size`` together (``Session.answer_many``): each answer is the one
    ``ask`` gives it alone. ``on_answer(i, answer)`` as each item's answer is complete."""
    arguments.question_arguments("ask_many", gen, cache, items)
    batch_size = arguments.batch_size("ask_many", batch_size)
    plans: list[tuple[str, int, int, list[Prompt]]] = []  # kind, document tokens, room, prompts
    for context, question in items:
        prompt = one_prompt(session, context, question, gen.gen_length, long)
        if prompt is None:
            ids = session.document_ids(context)
            prompts, room = part_prompts(session, context, ids, room_needed(session, question, gen.gen_length),
                                         question)
            plans.append(("parts", len(ids), room, prompts))
        else:
            plans.append(("one", 0, 0, [prompt]))
    flat = [(i, prompt) for i, plan in enumerate(plans) for prompt in plan[3]]
    got: dict[int, list[Answer | None]] = {i: [None] * len(plan[3]) for i, plan in enumerate(plans)}
    position = {k: sum(1 for j, _ in flat[:k] if j == i) for k, (i, _) in enumerate(flat)}
    results: dict[int, Answer] = {}

    def one_done(k: int, answer: Answer) -> None:
        i, prompt = flat[k]
        got[i][position[k]] = replace(answer, fitted=prompt.fitted)
        if all(a is not None for a in got[i]):
            kind, n_tokens, room, _ = plans[i]
            done = [a for a in got[i] if a is not None]
            results[i] = parts_answer(items[i][0], n_tokens, room, done) if kind == "parts" else done[0]
            if on_answer is not None:
                on_answer(i, results[i])

    session.answer_many([p.ids for _, p in flat], gen, cache, batch_size, on_answer=one_done,
                        document_lens=[p.document_len for _, p in flat],
                        rope_factors=[p.fitted.rope_factor for _, p in flat])
    return [results[i] for i in range(len(items))]


def common_source(spans: Sequence[Span]) -> tuple[Span, ...]:
    """Where an answer given by these parts came from: the characters they all share when they overlap (two
    neighbouring parts that found the same fact both hold it, in their overlap), else each of their spans."""
    start, end = max(a for a, _ in spans), min(b for _, b in spans)
    return ((start, end),) if len(spans) > 1 and start < end else tuple(spans)


def used_every_token(session: Session, answer: Answer) -> bool:
    """Whether ``answer`` ran to its last token without an end-of-text token: its token budget cut it."""
    stops = stop_ids(session.tokenizer, session.model.config)
    return not any(t in stops for t in answer.result.tokens[0].tolist())


def _normal(text: str) -> str:
    return " ".join(text.split()).casefold()


def says_absent(text: str) -> bool:
    """Whether an answer is the "not in the document" of a model trained to say it (``NO_ANSWER``)."""
    return _normal(text) == _normal(NO_ANSWER)


def _rank(conf: Confidence | None) -> tuple[float, float]:
    """How sure an answer is, for choosing among parts: the statistic the low-confidence rule uses, then the other."""
    if conf is None:
        return (-1.0, -1.0)
    return (conf.min, conf.mean) if LOW_CONFIDENCE_STATISTIC == "min" else (conf.mean, conf.min)


def choose_part(answers: Sequence[Answer]) -> tuple[Answer, list[Answer]]:
    """(the answer to give, the parts it came from) for the parts' answers of one question, in text order.

    Parts that give an answer (neither empty nor "not in the document") are grouped by their text; the group whose
    most confident part is the most confident of all wins (ties: the first in the text), and the answer is that
    part's, from every part of the group. When no part gives an answer: "not in the document" when every part says
    so (the least confident of them, from every part), else no answer (an empty part's)."""
    if not answers:
        raise ValueError("no part to choose from")
    groups: dict[str, list[Answer]] = {}
    for answer in answers:
        if answer.text.strip() and not says_absent(answer.text):
            groups.setdefault(_normal(answer.text), []).append(answer)
    if groups:
        best = max(groups.values(), key=lambda group: max(_rank(a.confidence) for a in group))
        return max(best, key=lambda a: _rank(a.confidence)), best
    if all(says_absent(a.text) for a in answers):
        return min(answers, key=lambda a: _rank(a.confidence)), list(answers)
    empty = next(a for a in answers if not a.text.strip())
    return empty, list(answers)


def parts_stats(stats: Sequence[RunStats]) -> RunStats:
    """One run's statistics for a text read in several prompts: times, steps, answer and prompt tokens summed;
    memory and the cache kept are the largest of one prompt (the parts run one after another)."""
    first, largest = stats[0], max(stats, key=lambda s: s.kv_full_bytes)
    return replace(first, prompt_len=sum(s.prompt_len for s in stats), gen_length=sum(s.gen_length for s in stats),
                   steps_run=sum(s.steps_run for s in stats), prefill_s=sum(s.prefill_s for s in stats),
                   step_s=[t for s in stats for t in s.step_s], total_s=sum(s.total_s for s in stats),
                   peak_mem_bytes=max(s.peak_mem_bytes for s in stats), kv_entries=largest.kv_entries,
                   kv_bytes=largest.kv_bytes, kv_full_bytes=largest.kv_full_bytes,
                   setup_s=sum(s.setup_s for s in stats))


# ------------------------------------------------------------------------------------------- what an answer says

# The question form the embedded model was trained to answer (``tasks.synthetic.QUESTION_SINGLE``): only of these
# is its "not in the document" a measured finding (docs/tiny-model.md: 91% of absent keys, never for a present one).
_TRAINED_QUESTION = re.compile(r"what is the special magic number for [^\s?]+\s*\?", re.IGNORECASE)

# What an answer states: ``answer`` (the model gave one), ``absent`` ("not in the document", as a finding: every
# character read within the model's window, by a model shown to say so reliably, to a question of the form it was
# shown on), ``absent-in-read`` (said of a document partly cut), ``absent-unverified`` (said of all of it by a model
# or under a RoPE scaling not shown to say it reliably), ``untrained-question`` (the embedded model, asked a question
# of another form than it was trained on: its answer says nothing about the document), ``empty`` (no answer).
CLAIMS = ("answer", "absent", "absent-in-read", "absent-unverified", "untrained-question", "empty")


def trained_question(question: str) -> bool:
    """Whether ``question`` has the form the embedded model was trained on ("What is the special magic number for
    KEY?")."""
    return _TRAINED_QUESTION.fullmatch(question.strip()) is not None


def claim(answer: Answer, question: str, embedded: bool) -> str:
    """What kind of statement ``answer`` (to ``question``; ``embedded``: from the embedded model) is: one of
    ``CLAIMS``."""
    if not answer.text.strip():
        return "empty"
    if embedded and not trained_question(question):
        return "untrained-question"
    if not says_absent(answer.text):
        return "answer"
    fitted = answer.fitted
    if fitted is not None and not fitted.complete:
        return "absent-in-read"
    if not embedded or (fitted is not None and fitted.mode == "rope-scale"):  # read past the window, scaled or not
        return "absent-unverified"
    return "absent"


def confidence_fields(answer: Answer, what: str, embedded: bool) -> dict[str, Any]:
    """``confidence`` (mean/min token probability, or null for an empty answer) and, for an empty one, ``note``
    saying so (``what``: answer or summary; ``embedded``: the note names the embedded model's limits)."""
    from maskkv_cli.models.catalog import empty_note

    fields: dict[str, Any] = {"confidence": answer.confidence.as_dict() if answer.confidence else None}
    if not answer.text.strip():
        fields["note"] = empty_note(what, embedded)
    return fields


def spans_pages(spans: Sequence[Span], pages: Sequence[tuple[int, int, int]]) -> list[int]:
    """The numbers of the pages (``Document.page_spans()``: number, start, end) that the character spans touch."""
    return [number for number, start, end in pages
            if any(a < max(end, start + 1) and b > start for a, b in spans)]


def reading_fields(fitted: FittedContext | None, pages: Sequence[tuple[int, int, int]] | None) -> dict[str, Any]:
    """``read``: the mode, whether everything was read, the character spans read and (with the document's page
    spans) the pages read and not read, the parts; ``source``: the spans (and pages) the answer came from."""
    if fitted is None:
        return {}
    read: dict[str, Any] = {"mode": fitted.mode, "complete": fitted.complete, "chars": fitted.chars,
                            "spans": [list(s) for s in fitted.read], "parts": fitted.parts}
    fields: dict[str, Any] = {"read": read, "source": {"spans": [list(s) for s in fitted.source]}}
    if pages is not None:
        add_pages(fields, pages)
    return fields


def add_pages(row: dict[str, Any], pages: Sequence[tuple[int, int, int]]) -> None:
    """Name by page (``Document.page_spans()``) what a row's ``read``, ``source`` and parts' spans cover: the pages
    read and not read, and the pages each answer came from (a batch names them where the document is known)."""
    read = row.get("read")
    if read is None:
        return
    seen = spans_pages(read["spans"], pages)
    # the total in the file's numbering: its blank pages hold no text but count (it said "pages 1, 59 of 30" where
    # the even pages of 60 are blank)
    read.update(pages=seen, pages_not_read=[number for number, _, _ in pages if number not in seen],
                pages_total=max((number for number, _, _ in pages), default=0))
    for source in [row["source"], *row.get("parts", [])]:
        source["pages"] = spans_pages(source["spans"], pages)


def answer_row(answer: Answer, embedded: bool, question: str = "",
               pages: Sequence[tuple[int, int, int]] | None = None) -> dict[str, Any]:
    """The fields of one answer that ``ask --json`` and a batch row share: its text, what kind of statement it is
    (``claim``, for ``question``), its confidence, what was read (with ``pages``, a document's page spans, by
    page), the budget, the prompt and dropped tokens, the RoPE factor and the run statistics; for a text read in
    parts, each part's answer."""
    fitted = answer.fitted
    row = {"answer": answer.text, "claim": claim(answer, question, embedded),
           **confidence_fields(answer, "answer", embedded), **reading_fields(fitted, None),
           "budget": answer.budget, "prompt_tokens": answer.prompt_len,
           "dropped_tokens": fitted.dropped if fitted else 0, "rope_factor": fitted.rope_factor if fitted else 1,
           "stats": answer.result.stats.as_dict()}
    if isinstance(answer, PartsAnswer):
        row["parts"] = [{"answer": a.text, "confidence": a.confidence.as_dict() if a.confidence else None,
                         **reading_fields(a.fitted, None)["source"]} for a in answer.parts]
    if pages is not None:
        add_pages(row, pages)
    return row
