"""One chat request answered: the run settings it asks for, the question about its documents through
``pipeline.ask`` (in the worker thread), the committed text streamed as the sampler fixes it, and the figures maskkv
adds to the answer (the cache kept vs full, times, confidence, the page map of what the cache kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from maskkv_cli.app.pipeline import Answer, answer_row, ask
from maskkv_cli.app.run_settings import RunSettings
from maskkv_cli.app.session import Session
from maskkv_cli.documents import Document
from maskkv_cli.engine.plan import CacheConfig
from maskkv_cli.errors import UsageError
from maskkv_cli.models.catalog import empty_note
from maskkv_cli.prompting import decode_answer, stop_ids
from maskkv_cli.prompting.fit import PARTS_HINT
from maskkv_cli.reports.answers import answer_line, context_line
from maskkv_cli.reports.pagemap import PageMap, map_pages
from maskkv_cli.sampling import Event, GenerationConfig
from maskkv_cli.server.chat_request import ChatRequest
from maskkv_cli.server.errors import bad_request
from maskkv_cli.server.runner import Job

__all__ = ["Completion", "CommittedText", "Plan", "answer_chat", "plan_request"]

# a request cannot ask for parts (``chat_request.LONG_MODES``) and serve's default is truncate: how it reads it all
SERVER_PARTS_HINT = "a server started with --long parts reads it all"
REPLACEMENT = "\ufffd"  # what a decoder shows for the first bytes of a character whose last bytes are still masked


@dataclass(frozen=True)
class Plan:
    """What one request runs: the generation settings, the cache request and how a long document is fitted."""

    settings: RunSettings
    gen: GenerationConfig
    cache: CacheConfig
    long: str


def plan_request(req: ChatRequest, defaults: RunSettings, long: str, session: Session) -> Plan:
    """The server's run settings with the request's own on top, checked (a 400 names what is wrong)."""
    ext = req.maskkv
    changes: dict[str, Any] = {}
    if ext.policy is not None:
        changes["policy"] = ext.policy
    if ext.budget is not None:
        changes.update(budget=ext.budget, ratio=None)
    if ext.ratio is not None:
        changes.update(ratio=ext.ratio, budget=None)
    for name, value in (("threshold", ext.threshold), ("layer_budgets", ext.layer_budgets),
                        ("temperature", req.temperature), ("seed", req.seed)):
        if value is not None:
            changes[name] = value
    settings = replace(defaults, **changes)
    if req.max_tokens is not None and req.max_tokens > session.window:
        raise bad_request(f"max_tokens must be at most {session.window} (the model's window, which the prompt "
                          f"shares); got {req.max_tokens}", "max_tokens")
    try:
        if req.max_tokens is None:
            gen = settings.generation(session.generation_defaults)
        else:  # a length the request sets: blocks of the server's or the model's length when they divide it
            gen = settings.answer_generation(req.max_tokens, session.generation_defaults.get("block_length"))
        cache = settings.cache()
        settings.check_family(session.model.config.family)
    except UsageError as exc:
        raise bad_request(f"{exc} (the server's settings with this request's)", "maskkv") from None
    return Plan(settings, gen, cache, ext.long or long)


class CommittedText:
    """The answer's text as far as the sampler has committed it, handed on in pieces (``send``) as it grows.

    A diffusion model fixes its answer a block at a time: a token, once committed, never changes, so the text of
    the longest run of committed tokens from the start is final. It is sent when it grows, less what cannot be sent
    yet: a character whose last bytes are still masked, and an ending that may be the start of a stop string. The
    pieces joined give the final answer (``finish``), cut at the first stop string. ``limit``: the most tokens
    the answer may have (the request's ``max_tokens``; a sampler that fills whole canvases commits more).
    """

    def __init__(self, tokenizer: Any, stops: set[int], mask_id: int, stop_strings: Sequence[str],
                 send: Callable[[str], None] | None, limit: int | None = None) -> None:
        self.tokenizer, self.stops, self.mask_id = tokenizer, stops, mask_id
        self.stop_strings = tuple(stop_strings)
        self.limit = limit
        self.send = send
        self.sent = ""
        self.committed = 0  # tokens of the committed prefix last decoded
        self.stopped = False  # a stop string was met: nothing more is sent

    def update(self, tokens: Sequence[int]) -> None:
        """The response after a step (the mask id where nothing is committed yet)."""
        prefix: list[int] = []
        for t in tokens if self.limit is None else tokens[: self.limit]:
            if t == self.mask_id:
                break
            prefix.append(t)
            if t in self.stops:
                break
        if len(prefix) == self.committed or self.stopped:
            return
        self.committed = len(prefix)
        self.offer(decode_answer(self.tokenizer, prefix, self.stops, self.mask_id), final=False)

    def finish(self, text: str) -> tuple[str, bool]:
        """The final answer cut at its first stop string, and whether one was met; sends what is left of it."""
        cut, met = cut_at_stop(text, self.stop_strings)
        self.offer(cut, final=True)
        return cut, met

    def offer(self, text: str, final: bool) -> None:
        if self.stopped:
            return
        text, met = cut_at_stop(text, self.stop_strings)
        if not final and not met:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - pending_stop(text, self.stop_strings)]
        self.stopped = met
        if self.send is not None and len(text) > len(self.sent) and text.startswith(self.sent):
            self.send(text[len(self.sent) :])
            self.sent = text


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first of ``stop_strings`` in it, and whether there was one."""
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def pending_stop(text: str, stop_strings: Sequence[str]) -> int:
    """How many characters at the end of ``text`` may be the start of a stop string (held back until known)."""
    best = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


@dataclass(frozen=True)
class Completion:
    """One answered request, in the terms of the API's answer."""

    text: str
    finish_reason: str  # stop: an end-of-text token or a stop string; length: max_tokens ran out
    prompt_tokens: int
    completion_tokens: int
    figures: dict[str, Any]  # the answer's ``maskkv`` object


def answer_chat(job: Job[Completion], session: Session, plan: Plan, req: ChatRequest, docs: Sequence[Document],
                embedded: bool, send: Callable[[str], None] | None = None) -> Completion:
    """Answer ``req`` about ``docs`` (runs in the worker thread: the model and tokenizer are used there only).
    Between denoising steps the job is checked (the client gone, the time limit) and, when ``send`` is given, the
    newly committed text is sent. An answer is cut to the request's ``max_tokens`` where the sampler ran past it
    (DiffusionGemma denoises whole canvases)."""
    cfg = session.model.config
    stops = stop_ids(session.tokenizer, cfg)
    limit = req.max_tokens
    text = CommittedText(session.tokenizer, stops, cfg.mask_token_id, req.stop, send, limit)
    in_parts: list[bool] = []  # set when the document is read in parts (``--long parts``)

    def on_part(i: int, n: int) -> None:
        if n > 1:  # each part's own answer is not the final one: the answer is sent whole when it is known
            in_parts.append(True)

    def on_event(event: Event) -> None:
        job.check()
        if send is not None and event.tokens is not None and not in_parts:
            text.update(event.tokens[0].tolist())

    context = "\n\n".join(doc.text for doc in docs)
    answer = ask(session, context, req.question, plan.gen, plan.cache, long=plan.long, on_event=on_event,
                 on_part=on_part)
    job.check()
    tokens = answer.result.tokens[0].tolist()
    ended = next((i for i, t in enumerate(tokens) if t in stops), None)
    used = tokens if ended is None else tokens[:ended]
    whole = answer.text
    if limit is not None and len(used) > limit:  # the answer's first max_tokens tokens, ended by the limit
        used, ended = used[:limit], None
        whole = decode_answer(session.tokenizer, used, stops, cfg.mask_token_id)
    final, met = text.finish(whole)
    completion_tokens = sum(1 for t in used if t != cfg.mask_token_id)
    figures = answer_figures(answer, plan, docs, embedded, session, req.question)
    finish = "stop" if met or ended is not None else "length"
    return Completion(final, finish, answer.prompt_len, completion_tokens, figures)


def answer_figures(answer: Answer, plan: Plan, docs: Sequence[Document], embedded: bool, session: Session,
                   question: str) -> dict[str, Any]:
    """The answer's ``maskkv`` object: the fields ``maskkv ask --json`` gives an answer (confidence, budget, prompt
    and dropped tokens, RoPE factor, run statistics with the KV bytes kept and full), the policy, the documents,
    the notes, and the page map of what the cache kept."""
    row = answer_row(answer, embedded, question)  # (its claim is judged against the question, as ask's)
    # the answer as `maskkv ask` shows it (None: none to show, as the embedded model's "not in the document" to a
    # question it was not trained on) and the line that goes with it: a client shows these, not the bare text
    words = {"shown": answer_line(row), "context": context_line(row, empty_note("answer", embedded))}
    row.pop("answer")  # the text is the choice's message
    fitted = answer.fitted
    notes = [n.replace(PARTS_HINT, SERVER_PARTS_HINT) for n in [fitted.rule if fitted else None, *answer.notes] if n]
    figures: dict[str, Any] = {"policy": plan.cache.policy, **row, **words, "notes": notes,
                               "documents": [{"id": d.sha256, "filename": d.name, "pages": len(d.pages)}
                                             for d in docs]}
    if len(docs) == 1 and fitted is not None and fitted.parts > 1:
        figures["page_map"] = {"mapped": False, "note": f"the document was read in {fitted.parts} parts; the page map "
                                                        "covers a document read in one prompt"}
    elif len(docs) == 1 and fitted is not None:
        records = sorted(answer.result.records, key=lambda r: r.layer)
        mapped = map_pages(session.tokenizer, docs[0], fitted.text, question, records, answer.prompt_len,
                           fitted.dropped)
        figures["page_map"] = mapped.as_dict() if isinstance(mapped, PageMap) else {"mapped": False, "note": mapped}
    elif docs:
        figures["page_map"] = {"mapped": False, "note": f"the page map covers one document; this request read "
                                                        f"{len(docs)}"}
    return figures
