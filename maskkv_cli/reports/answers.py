"""The words for one answer, from its row (``pipeline.answer_row``): the line that stands for the answer, and the
line that goes with it (its confidence and where it came from, or why there is no answer to show).

``maskkv ask`` prints them and ``maskkv batch`` writes them into summary.md, so both say the same thing: an
answer read from a cut document says so on its own line, an absence is "not in the document" only when
``pipeline.claim`` found it a finding, and the embedded model asked a question it was not trained on is labelled
for what it is.
"""

from __future__ import annotations

import math
from typing import Any

from maskkv_cli.app.pipeline import says_absent
from maskkv_cli.defaults import PULL_HINT, REAL_MODEL
from maskkv_cli.documents.model import pages_label

__all__ = ["answer_line", "cell_confidence", "confidence_words", "context_line", "read_words", "under_cut",
           "untrained_note"]

NO_ANSWER_SHOWN = "(no answer, see the note below)"


def under_cut(value: float) -> float:
    """A probability shown beside LOW, rounded down to two places, so that it never reads as the cut itself."""
    return math.floor(value * 100) / 100


def confidence_words(conf: dict[str, Any] | None, advice: str = "check the answer in the document") -> str:
    """One line for a confidence (``Confidence.as_dict()``): its two numbers, and a warning when the chosen
    statistic is under the cut, with ``advice`` (empty: none). The statistic under the cut is shown rounded down,
    so that it never reads as the cut itself (a min of 0.9453 is "0.94", below 0.95, not "0.95")."""
    if conf is None:
        return "confidence: none (no answer tokens)"
    low = bool(conf["low"])
    chosen = "mean" if conf.get("statistic") == "mean" else "min"
    shown = {k: under_cut(conf[k]) if low and k == chosen else conf[k] for k in ("mean", "min")}
    numbers = f"mean {shown['mean']:.2f}, min {shown['min']:.2f} over {conf['tokens']} tokens"
    if low:
        why = "the mean" if chosen == "mean" else "a token"
        return (f"LOW CONFIDENCE ({numbers}; {why} below {conf['threshold']:.2f}): the model is probably guessing"
                + (f", {advice}" if advice else ""))
    return f"confidence: {numbers}"


def _chars(spans: list[list[int]]) -> str:
    return " and ".join(f"{a + 1:,}-{b:,}" for a, b in spans)


def read_words(read: dict[str, Any]) -> str:
    """What a partial reading covered and left out, e.g. ``read pages 1-3, 30-36 of 36; pages 4-29 were cut
    (--long truncate; the default --long parts reads them all)``."""
    why = f"--long {read['mode']}; the default --long parts reads them all"
    if read.get("pages") is not None:
        left = read["pages_not_read"]
        cut = f"{pages_label(left)} {'was' if len(left) == 1 else 'were'} cut" if left else "parts of pages were cut"
        return f"read {pages_label(read['pages'])} of {read['pages_total']}; {cut} ({why})"
    return f"read characters {_chars(read['spans'])} of {read['chars']:,}; the rest was cut ({why})"


def untrained_note(answer: str) -> str:
    """Why the embedded model's answer to a question of another form than its training's says nothing."""
    said = "its \"not in the document\" here" if says_absent(answer) else "its answer"
    return (f"the embedded tiny model only answers questions of the form \"What is the special magic number for "
            f"KEY?\" about text holding \"The special magic number for KEY is NUMBER.\"; {said} says nothing about "
            f"the document. For real answers: `{PULL_HINT}`, then --model {REAL_MODEL}.")


def answer_line(row: dict[str, Any]) -> str | None:
    """The line that stands for the answer (stdout), or None when there is none to show (no answer, or the
    embedded model's "not in the document" to a question it was not trained on: ``context_line`` says why)."""
    claim, text, read = row["claim"], row["answer"], row.get("read") or {}
    if claim == "empty" or (claim == "untrained-question" and says_absent(text)):
        return None
    if claim == "untrained-question":
        return f"{text} [a guess: the question is not of the form the embedded model was trained on]"
    if claim == "absent":
        return text
    if claim == "absent-in-read":
        return f"not in the part read [{read_words(read)}]"
    if claim == "absent-unverified":
        if (row.get("rope_factor") or 1) > 1:
            why = (f"read with the RoPE base scaled x{row['rope_factor']}, beyond the window the model was trained "
                   "on; --long parts reads it within the window")
        elif read.get("mode") == "rope-scale":
            why = ("read beyond the window the model was trained on, its RoPE unscaled; --long parts reads it within "
                   "the window")
        else:
            why = "the model's claim: maskkv has not measured how reliably this model says so"
        return f"{text} [{why}]"
    return text if read.get("complete", True) else f"{text} [{read_words(read)}]"


def _from_where(row: dict[str, Any]) -> str:
    read, source = row.get("read") or {}, row.get("source") or {}
    if not read or read.get("mode") not in ("parts",):
        return ""
    where = (pages_label(source["pages"]) if source.get("pages")
             else f"characters {_chars(source['spans'])}")
    whole = (f"all {read['pages_total']} pages" if read.get("pages_total") else "all of it")
    if row["claim"] == "absent":
        return f"; every one of the {read['parts']} parts says so (read {whole})"
    return f"; from {where} (read {whole} in {read['parts']} parts)"


def context_line(row: dict[str, Any], empty_note: str) -> str:
    """The line that goes with the answer (stderr): its confidence and, for a text read in parts, where it came
    from; for no answer, ``empty_note``; for the embedded model asked a question of another form, why its answer
    says nothing."""
    claim = row["claim"]
    if claim == "empty":
        return "note: " + empty_note
    if claim == "untrained-question":
        return "note: " + untrained_note(row["answer"])
    return confidence_words(row["confidence"]) + _from_where(row)


def cell_confidence(row: dict[str, Any]) -> str:
    """The confidence of an answer in a few words for a table cell: ``1.00 / 0.99``, ``LOW 0.62 / 0.41``, or what
    stands in for it (``-`` for no answer, ``untrained question`` for the embedded model asked another form)."""
    if row.get("claim") == "untrained-question":
        return "untrained question"
    conf = row.get("confidence")
    if not conf:
        return "-"
    if conf["low"]:  # (rounded down: "LOW 0.97 / 0.95" read as a pass)
        return f"LOW {under_cut(conf['mean']):.2f} / {under_cut(conf['min']):.2f}"
    return f"{conf['mean']:.2f} / {conf['min']:.2f}"
