"""Synthetic long-context retrieval tasks (RULER style); their JSONL input and output is ``tasks/taskio.py``.

Task families (``KINDS``):

- ``niah_single``: one needle "The special magic number for {key} is {number}." hidden between two
  paragraphs of haystack text; the question asks for the number.
- ``niah_multikey``: the real needle plus ``NUM_DISTRACTORS`` needles of the same form for other keys.
- ``niah_multivalue``: ``NUM_VALUES`` needles for the same key with different numbers; the answer is
  every number, joined by ", " in order of appearance.
- ``niah_none``: needles for other keys only (``NUM_DISTRACTORS``); the asked key has none, so the answer is
  ``NO_ANSWER`` (an unanswerable question, as in SQuAD 2.0).
- ``open_question``: a question of another form than the needle's (``open_questions.py``: what the text is
  about, who wrote it, a name, a date, the password for a key word), with 0 to ``NUM_DISTRACTORS`` needles in
  the text; nothing generated answers it, so the answer is ``NO_ANSWER``.
- ``lead_summary``: plain haystack text and the instruction ``summarize`` sends for each part; the reference is
  the text's first ``LEAD_SENTENCES`` sentences (the LEAD baseline of news summarization), scored with ROUGE-L.
- ``vt`` (variable tracking): "VAR ABCDE = 12345." followed by a chain "VAR FGHIJ = ABCDE." ... spread
  across the haystack, plus one distractor chain with another value; the answer is the names of the real
  chain joined by ", " in order of appearance.

Every kind accepts a user haystack (the paragraphs of a user's document, e.g. the text of a PDF) in place
of the packaged corpus: that is the "find the fact in a real document" setting. Its tasks keep the kind as
their ``dataset`` and record ``meta["haystack"] == "user"``.

Generation is deterministic: task ``i`` depends only on ``(kind, seed, i, length, haystack,
count_tokens, distractors)``, so asking for more tasks keeps the first ones unchanged. Numbers and variable names that
already occur in the haystack are never used, so every needle sentence occurs exactly once.

Lengths: ``length`` is a target for the whole context measured with ``count_tokens`` (whitespace words by
default). The haystack is taken as a contiguous run of paragraphs starting at a random paragraph (it wraps
around and repeats when the source is shorter than the target), the last paragraph is cut at a word
boundary, and the budget is corrected a few times against the measured length of the assembled context.
``Task.length`` follows LongBench and holds the number of whitespace words of the context; the measured
token count is ``meta["tokens"]``; ``meta["repeated"]`` is true when the context is longer than the whole
source text (so some paragraphs occur twice).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from maskkv_cli.documents.corpus import load_corpus
from maskkv_cli.prompting import NO_ANSWER
from maskkv_cli.prompting.parts import LEAD_SENTENCES, SUMMARY_WORDS, lead_sentences, part_instruction
from maskkv_cli.tasks.open_questions import open_question
from maskkv_cli.tasks.taskio import Task, count_words, task_id

KINDS: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "niah_none", "lead_summary",
                          "open_question")
# The kinds no generated text answers: their answer is NO_ANSWER.
UNANSWERABLE_KINDS: tuple[str, ...] = ("niah_none", "open_question")

# Simple lowercase English words used as needle keys.
KEY_WORDS: tuple[str, ...] = (
    "apple", "anchor", "badge", "basket", "beach", "bell", "blanket", "boat", "bottle", "branch",
    "bridge", "brush", "bucket", "button", "cabin", "camera", "candle", "carpet", "castle", "chair",
    "cherry", "circle", "cloud", "coat", "coin", "comb", "cookie", "corner", "cotton", "crayon",
    "desert", "diamond", "dinner", "doctor", "dragon", "drum", "eagle", "engine", "feather", "fence",
    "finger", "flag", "forest", "garden", "giant", "glove", "grape", "guitar", "hammer", "harbor",
    "helmet", "honey", "island", "jacket", "jelly", "kettle", "kitten", "ladder", "lemon", "letter",
    "lizard", "magnet", "marble", "meadow", "mirror", "monkey", "needle", "nest", "ocean", "orange",
    "paddle", "palace", "pencil", "pepper", "pillow", "planet", "pocket", "potato", "puzzle", "rabbit",
    "ribbon", "rocket", "saddle", "shadow", "shovel", "silver", "spoon", "stamp", "sugar", "summer",
    "table", "ticket", "tiger", "tomato", "tunnel", "turtle", "velvet", "violin", "wagon", "window",
    "winter", "zebra",
)  # fmt: skip

NEEDLE_TEMPLATE = "The special magic number for {key} is {value}."
QUESTION_SINGLE = "What is the special magic number for {key}?"
QUESTION_MULTIVALUE = "What are all the special magic numbers for {key}?"
VT_FIRST_TEMPLATE = "VAR {name} = {value}."
VT_LINK_TEMPLATE = "VAR {name} = {source}."
VT_QUESTION = "Which variables are assigned the value {value}?"
ANSWER_SEPARATOR = ", "
PARAGRAPH_SEPARATOR = "\n\n"

NUM_DISTRACTORS = 3  # niah_multikey: needles for other keys
NUM_VALUES = 4  # niah_multivalue: numbers for the asked key
VT_CHAIN_NAMES = 5  # vt: names per chain (one value assignment, then four links)
VT_DISTRACTOR_CHAINS = 1  # vt: chains that carry another value
NUMBER_DIGITS = (4, 7)  # niah numbers have 4 to 7 digits
VT_NAME_LETTERS = 5
VT_VALUE_DIGITS = 5

_FIT_ATTEMPTS = 4


def max_distractors() -> int:
    """The most distractor needles a niah_multikey task can have: one other key word each."""
    return len(KEY_WORDS) - 1


# --------------------------------------------------------------------------------------------------
# generation


@dataclass
class _Plan:
    """Needle sentences for one task, before placement."""

    question: str
    needles: list[str]
    depths: list[float]
    roles: list[str]  # "answer" or "distractor"
    payloads: list[str]  # what an answer needle contributes to the answer string
    facts: dict[str, Any]


class _Counter:
    """``count_tokens`` with a cache for the (repeatedly used) source paragraphs."""

    def __init__(self, fn: Callable[[str], int]) -> None:
        self.fn = fn
        self._paragraphs: dict[int, int] = {}

    def __call__(self, text: str) -> int:
        return int(self.fn(text))

    def paragraph(self, index: int, text: str) -> int:
        cached = self._paragraphs.get(index)
        if cached is None:
            cached = max(1, int(self.fn(text)))
            self._paragraphs[index] = cached
        return cached


def _new_number(rng: random.Random, digits: tuple[int, int], taken: set[str]) -> str:
    while True:
        size = rng.randint(digits[0], digits[1])
        value = str(rng.randint(10 ** (size - 1), 10**size - 1))
        if value not in taken:
            taken.add(value)
            return value


def _new_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(VT_NAME_LETTERS))
        if name not in taken:
            taken.add(name)
            return name


def _needle(key: str, value: str) -> str:
    return NEEDLE_TEMPLATE.format(key=key, value=value)


def _plan(kind: str, rng: random.Random, taken: set[str], distractors: int = NUM_DISTRACTORS) -> _Plan:
    digits = NUMBER_DIGITS
    if kind == "lead_summary":
        # No needles; the instruction asks for a length in words that summarize's --length may take.
        return _Plan(question=part_instruction(rng.choice(SUMMARY_WORDS)), needles=[], depths=[], roles=[],
                     payloads=[], facts={})
    if kind == "niah_none":
        keys = rng.sample(KEY_WORDS, distractors + 1)
        values = [_new_number(rng, digits, taken) for _ in keys[1:]]
        return _Plan(
            question=QUESTION_SINGLE.format(key=keys[0]),
            needles=[_needle(k, v) for k, v in zip(keys[1:], values, strict=True)],
            depths=[rng.random() for _ in values],
            roles=["distractor"] * distractors,
            payloads=values,
            facts={"key": keys[0], "distractor_keys": keys[1:]},
        )
    if kind == "open_question":
        keys = rng.sample(KEY_WORDS, distractors + 1)
        needle_keys = keys[1 : rng.randint(0, distractors) + 1]
        values = [_new_number(rng, digits, taken) for _ in needle_keys]
        return _Plan(
            question=open_question(rng, rng.choice(keys)),
            needles=[_needle(k, v) for k, v in zip(needle_keys, values, strict=True)],
            depths=[rng.random() for _ in values],
            roles=["distractor"] * len(values),
            payloads=values,
            facts={"distractor_keys": needle_keys},
        )
    if kind == "niah_single":
        key = rng.choice(KEY_WORDS)
        value = _new_number(rng, digits, taken)
        return _Plan(
            question=QUESTION_SINGLE.format(key=key),
            needles=[_needle(key, value)],
            depths=[rng.random()],
            roles=["answer"],
            payloads=[value],
            facts={"key": key},
        )
    if kind == "niah_multikey":
        keys = rng.sample(KEY_WORDS, distractors + 1)
        values = [_new_number(rng, digits, taken) for _ in keys]
        return _Plan(
            question=QUESTION_SINGLE.format(key=keys[0]),
            needles=[_needle(k, v) for k, v in zip(keys, values, strict=True)],
            depths=[rng.random() for _ in keys],
            roles=["answer"] + ["distractor"] * distractors,
            payloads=values,
            facts={"key": keys[0], "distractor_keys": keys[1:]},
        )
    if kind == "niah_multivalue":
        key = rng.choice(KEY_WORDS)
        values = [_new_number(rng, digits, taken) for _ in range(NUM_VALUES)]
        return _Plan(
            question=QUESTION_MULTIVALUE.format(key=key),
            needles=[_needle(key, v) for v in values],
            depths=[rng.random() for _ in values],
            roles=["answer"] * NUM_VALUES,
            payloads=values,
            facts={"key": key},
        )
    if kind == "vt":
        plan = _Plan(question="", needles=[], depths=[], roles=[], payloads=[], facts={})
        chains: list[list[str]] = []
        chain_values: list[str] = []
        for chain_index in range(1 + VT_DISTRACTOR_CHAINS):
            value = _new_number(rng, (VT_VALUE_DIGITS, VT_VALUE_DIGITS), taken)
            names = [_new_name(rng, taken) for _ in range(VT_CHAIN_NAMES)]
            # Sorted depths keep each chain in reading order: an assignment appears after its source.
            depths = sorted(rng.random() for _ in names)
            role = "answer" if chain_index == 0 else "distractor"
            for position, name in enumerate(names):
                if position == 0:
                    sentence = VT_FIRST_TEMPLATE.format(name=name, value=value)
                else:
                    sentence = VT_LINK_TEMPLATE.format(name=name, source=names[position - 1])
                plan.needles.append(sentence)
                plan.depths.append(depths[position])
                plan.roles.append(role)
                plan.payloads.append(name)
            chains.append(names)
            chain_values.append(value)
        plan.question = VT_QUESTION.format(value=chain_values[0])
        plan.facts = {"value": chain_values[0], "chains": chains, "chain_values": chain_values}
        return plan
    raise ValueError(f"unknown task kind {kind!r}; expected one of {', '.join(KINDS)}")


def _truncate(text: str, budget: int, counter: _Counter) -> str:
    """The longest word prefix of ``text`` whose token count is within ``budget`` ('' if none)."""
    words = text.split()
    low, high = 0, len(words)
    while low < high:
        middle = (low + high + 1) // 2
        if counter(" ".join(words[:middle])) <= budget:
            low = middle
        else:
            high = middle - 1
    return " ".join(words[:low])


def _take_haystack(
    paragraphs: Sequence[str], start: int, budget: int, counter: _Counter
) -> tuple[list[str], bool]:
    """Paragraphs from ``start`` on (wrapping around) within ``budget``; also whether any repeats."""
    taken: list[str] = []
    used = 0
    index = start
    while used < budget:
        source = index % len(paragraphs)
        text = paragraphs[source]
        cost = counter.paragraph(source, text)
        if used + cost <= budget:
            taken.append(text)
            used += cost
        else:
            piece = _truncate(text, budget - used, counter)
            if piece:
                taken.append(piece)
            break
        index += 1
    return taken, len(taken) > len(paragraphs)


def _place(
    haystack: Sequence[str], needles: Sequence[str], depths: Sequence[float]
) -> tuple[str, list[int], list[float]]:
    """Insert each needle as its own paragraph at the gap nearest to its depth.

    Returns the context, the character offset of every needle and the realised depth (gap / paragraphs).
    Needles that fall into the same gap keep their order in ``needles``.
    """
    count = len(haystack)
    gaps = [min(count, max(0, round(depth * count))) for depth in depths]
    order = sorted(range(len(needles)), key=lambda j: (gaps[j], j))
    pieces: list[tuple[str, int]] = []  # (text, needle index or -1)
    cursor = 0
    for gap in range(count + 1):
        while cursor < len(order) and gaps[order[cursor]] == gap:
            pieces.append((needles[order[cursor]], order[cursor]))
            cursor += 1
        if gap < count:
            pieces.append((haystack[gap], -1))
    starts = [0] * len(needles)
    parts: list[str] = []
    position = 0
    for number, (text, needle_index) in enumerate(pieces):
        if number:
            parts.append(PARAGRAPH_SEPARATOR)
            position += len(PARAGRAPH_SEPARATOR)
        if needle_index >= 0:
            starts[needle_index] = position
        parts.append(text)
        position += len(text)
    realised = [gap / count if count else 0.0 for gap in gaps]
    return "".join(parts), starts, realised


def _generate_one(
    kind: str,
    length: int,
    seed: int,
    index: int,
    paragraphs: Sequence[str],
    counter: _Counter,
    forbidden: set[str],
    source: str,
    distractors: int,
) -> Task:
    rng = random.Random(f"maskkv-bench:{kind}:{seed}:{index}")
    plan = _plan(kind, rng, set(forbidden), distractors)
    start = rng.randrange(len(paragraphs))

    needle_cost = sum(counter(needle) for needle in plan.needles)
    budget = length - needle_cost
    best: tuple[int, str, list[int], list[float], bool] | None = None
    for _ in range(_FIT_ATTEMPTS):
        haystack, repeated = _take_haystack(paragraphs, start, budget, counter) if budget > 0 else ([], False)
        context, starts, realised = _place(haystack, plan.needles, plan.depths)
        tokens = counter(context)
        if best is None or abs(tokens - length) < abs(best[0] - length):
            best = (tokens, context, starts, realised, repeated)
        if abs(tokens - length) <= max(1, length // 100):
            break
        budget += length - tokens
    assert best is not None
    tokens, context, starts, realised, repeated = best

    answer_needles = sorted(
        (starts[j], plan.payloads[j]) for j in range(len(plan.needles)) if plan.roles[j] == "answer"
    )
    answer = ANSWER_SEPARATOR.join(payload for _, payload in answer_needles)
    if kind in UNANSWERABLE_KINDS:
        answer = NO_ANSWER
    elif kind == "lead_summary":
        answer = " ".join(lead_sentences(context, LEAD_SENTENCES))
    needles_meta = [
        {"text": plan.needles[j], "start": starts[j], "depth": realised[j], "role": plan.roles[j],
         "value": plan.payloads[j]}
        for j in range(len(plan.needles))
    ]
    meta: dict[str, Any] = {
        "_id": task_id(kind, plan.question, context),
        "kind": kind,
        "seed": seed,
        "index": index,
        "haystack": source,
        "target_length": length,
        "tokens": tokens,
        "repeated": repeated,
        "needles": needles_meta,
        **plan.facts,
    }
    return Task(
        context=context,
        input=plan.question,
        answers=(answer,),
        dataset=kind,
        length=count_words(context),
        meta=meta,
    )


def present_keys(task: Task) -> list[str]:
    """The keys that have a needle in a ``niah_single`` or ``niah_multikey`` task's text."""
    return [task.meta["key"], *task.meta.get("distractor_keys", [])]


def absent_key_twin(task: Task, rng: random.Random, key: str | None = None) -> Task:
    """The same context asked about a key that has no needle in it: the unanswerable twin of a ``niah_single`` or
    ``niah_multikey`` task (answer ``NO_ANSWER``; the asked key's needle becomes one more distractor). Trained
    side by side, the two differ only in the question's key, so the one thing that tells them apart is whether
    that key's needle is in the text. ``key``: the absent key to ask about (default: one drawn uniformly)."""
    present = present_keys(task)
    if key is None:
        key = rng.choice([word for word in KEY_WORDS if word not in present])
    elif key in present:
        raise ValueError(f"the key {key!r} has a needle in the text; an absent-key twin asks about one that has none")
    question = QUESTION_SINGLE.format(key=key)
    meta = {**task.meta, "_id": task_id("niah_none", question, task.context), "kind": "niah_none", "key": key,
            "distractor_keys": present, "needles": [{**n, "role": "distractor"} for n in task.meta["needles"]]}
    return Task(context=task.context, input=question, answers=(NO_ANSWER,), dataset="niah_none", length=task.length,
                meta=meta)


@lru_cache(maxsize=16)
def _prepared(haystack: tuple[str, ...]) -> tuple[list[str], set[str]]:
    """Cleaned paragraphs and the words that a generated number or name must not collide with (cached: training
    draws one task at a time from the same large sources)."""
    paragraphs = [cleaned for cleaned in (" ".join(p.split()) for p in haystack) if cleaned]
    return paragraphs, set(re.findall(r"\w+", "\n".join(paragraphs)))


def generate_tasks(
    kind: str,
    n: int,
    length: int,
    seed: int,
    haystack: list[str] | None = None,
    count_tokens: Callable[[str], int] | None = None,
    distractors: int = NUM_DISTRACTORS,
) -> list[Task]:
    """Generate ``n`` tasks of ``kind`` whose contexts measure about ``length`` tokens.

    ``haystack``: paragraphs of a user's document to hide the needles in (default: the packaged corpus).
    ``count_tokens``: the length measure (default: whitespace words).
    ``distractors``: needles for other keys (niah_multikey and niah_none: that many; open_question: up to that
    many; RULER's multikey task: 3).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown task kind {kind!r}; expected one of {', '.join(KINDS)}")
    if n < 0:
        raise ValueError(f"the number of tasks must be >= 0, got {n}")
    if length < 1:
        raise ValueError(f"the target length must be >= 1, got {length}")
    if not 0 <= distractors <= max_distractors():
        raise ValueError(f"the number of distractor needles must be 0 to {max_distractors()}, got {distractors}")
    paragraphs, forbidden = _prepared(tuple(load_corpus() if haystack is None else haystack))
    source = "corpus" if haystack is None else "user"
    if not paragraphs:
        raise ValueError("the haystack has no text")
    counter = _Counter(count_tokens or count_words)
    return [
        _generate_one(kind, length, seed, index, paragraphs, counter, forbidden, source, distractors)
        for index in range(n)
    ]
