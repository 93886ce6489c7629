"""Scoring: the LongBench v1 per-task metrics, and exact match for the synthetic retrieval tasks.

Every metric takes ``(prediction, ground_truth, **kwargs)`` and returns a float in [0, 1];
``score`` takes the maximum over the gold answers and ``aggregate`` reports ``round(100 * mean, 2)``.

Faithfulness to the published LongBench harness:

- ``qa_f1``, ``classification_score``, ``retrieval_score``, ``count_score`` and ``code_sim_score``
  follow the official rules, including two quirks: classification drops matched classes while walking
  the same list, so a class right after a dropped one is never checked for dropping; the code line is
  scored with the difflib ratio rounded to an integer percentage, where two equal strings score 100 and
  an empty one against a non-empty one scores 0.
- ``rouge_l`` reproduces the ``rouge`` package's summary-level ROUGE-L F: sentences split on ".",
  words split on single spaces, no lowercasing, recall over the distinct reference words, precision over
  the distinct prediction words, and the union of the LCS words over every reference/prediction sentence
  pair (same back-tracking order). It differs in one way: the package overflows Python's recursion limit on
  sentence pairs of roughly a thousand words and LongBench then scores 0; here such pairs are scored.
- Chinese variants are simplified: LongBench segments Chinese with jieba; here every non-space character is
  one token (``qa_f1_zh``, ``rouge_l_zh``), and punctuation is every Unicode punctuation character plus the
  ASCII punctuation and full-width ASCII symbols, in place of LongBench's fixed list.

``exact_match`` (the synthetic retrieval tasks; ``lead_summary`` is scored with ``rouge_l``) compares after normalising
both sides (strip, casefold, collapse whitespace) and accepts either of two things: the gold equals the prediction's
first line, or the gold's token sequence occurs contiguously in the prediction's tokens. Tokens are runs of
letters/digits/underscore and single punctuation marks, so a needle number counts only as a whole word: gold "4321"
matches "The number is 4321." but not "43210".
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from difflib import SequenceMatcher

from maskkv_cli.tasks.synthetic import KINDS
from maskkv_cli.tasks.taskio import Task

Metric = Callable[..., float]

_ASCII_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")
_EM_TOKEN = re.compile(r"\w+|[^\w\s]")


# --------------------------------------------------------------------------------------------------
# helpers


def first_line(prediction: str) -> str:
    """The first line of a prediction after leading newlines (LongBench's rule for trec/triviaqa/...)."""
    return prediction.lstrip("\n").split("\n")[0]


def normalize_answer(text: str) -> str:
    """LongBench QA normalisation: lowercase, drop ASCII punctuation, drop a/an/the, collapse spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _ASCII_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _is_zh_punctuation(ch: str) -> bool:
    if ch in _ASCII_PUNCTUATION or unicodedata.category(ch).startswith("P"):
        return True
    return 0xFF01 <= ord(ch) <= 0xFF65 and not ch.isalnum()


def normalize_zh_answer(text: str) -> str:
    """Chinese normalisation: lowercase, drop punctuation (see module notes), drop all whitespace."""
    return "".join(ch for ch in text.lower() if not ch.isspace() and not _is_zh_punctuation(ch))


def _token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    overlap = sum((Counter(prediction) & Counter(ground_truth)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction)
    recall = overlap / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


# --------------------------------------------------------------------------------------------------
# LongBench metrics


def qa_f1(prediction: str, ground_truth: str, **_: object) -> float:
    """Token-multiset F1 after ``normalize_answer``; no overlap (including both empty) scores 0."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh(prediction: str, ground_truth: str, **_: object) -> float:
    """Character-level F1 after ``normalize_zh_answer`` (LongBench uses jieba words)."""
    return _token_f1(list(normalize_zh_answer(prediction)), list(normalize_zh_answer(ground_truth)))


def _sentences(text: str) -> list[list[str]]:
    """The ``rouge`` package's split: on ".", keep non-empty pieces, collapse spaces, split on " "."""
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if piece]


def _lcs_words(reference: Sequence[str], candidate: Sequence[str]) -> set[str]:
    """The words of one longest common subsequence, chosen with the ``rouge`` package's back-tracking."""
    rows, cols = len(reference), len(candidate)
    table = [[0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(1, rows + 1):
        above, row, word = table[i - 1], table[i], reference[i - 1]
        for j in range(1, cols + 1):
            if word == candidate[j - 1]:
                row[j] = above[j - 1] + 1
            else:
                row[j] = max(above[j], row[j - 1])
    words: set[str] = set()
    i, j = rows, cols
    while i > 0 and j > 0:
        if reference[i - 1] == candidate[j - 1]:
            words.add(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l(prediction: str, ground_truth: str, **_: object) -> float:
    """Summary-level ROUGE-L F on whitespace words, no lowercasing; an empty side scores 0."""
    hypothesis = _sentences(prediction)
    reference = _sentences(ground_truth)
    if not hypothesis or not reference:
        return 0.0
    reference_words = len({word for sentence in reference for word in sentence})
    hypothesis_words = len({word for sentence in hypothesis for word in sentence})
    union: set[str] = set()
    for reference_sentence in reference:
        for hypothesis_sentence in hypothesis:
            union |= _lcs_words(reference_sentence, hypothesis_sentence)
    recall = len(union) / reference_words
    precision = len(union) / hypothesis_words
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


def rouge_l_zh(prediction: str, ground_truth: str, **_: object) -> float:
    """``rouge_l`` over characters (LongBench joins jieba words with spaces instead)."""

    def spaced(text: str) -> str:
        return " ".join(ch for ch in text if not ch.isspace())

    return rouge_l(spaced(prediction), spaced(ground_truth))


def classification_score(
    prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None, **_: object
) -> float:
    """1 / (number of matching classes) when the gold class is among them, else 0.

    Classes match when they are substrings of the prediction; matches that are substrings of the gold
    without being equal to it are dropped (with the official harness's skip-after-drop behaviour).
    """
    if all_classes is None:
        raise ValueError("classification scoring needs the list of classes (all_classes)")
    matches = [name for name in all_classes if name in prediction]
    position = 0
    while position < len(matches):
        term = matches[position]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        position += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_equal(prediction: str, gold_number: str) -> float:
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(1 for number in numbers if number == gold_number) / len(numbers)


def _gold_paragraph(ground_truth: str, pattern: str) -> str:
    found = re.findall(pattern, ground_truth) or _NUMBER.findall(ground_truth)
    if not found:
        raise ValueError(f"no paragraph number in the gold answer {ground_truth!r}")
    return found[0]


def retrieval_score(prediction: str, ground_truth: str, **_: object) -> float:
    """Share of the numbers in the prediction equal to the gold's ``Paragraph N`` (or its first number)."""
    return _share_equal(prediction, _gold_paragraph(ground_truth, r"Paragraph (\d+)"))


def retrieval_zh_score(prediction: str, ground_truth: str, **_: object) -> float:
    """``retrieval_score`` with the Chinese gold pattern ``段落N``."""
    return _share_equal(prediction, _gold_paragraph(ground_truth, r"段落(\d+)"))


def count_score(prediction: str, ground_truth: str, **_: object) -> float:
    """Share of the numbers in the prediction equal to the gold number."""
    return _share_equal(prediction, ground_truth.strip())


def fuzzy_ratio(left: str, right: str) -> int:
    """Integer percentage similarity (difflib ratio), 100 for equal strings, 0 if one side is empty."""
    if left == right:
        return 100
    if not left or not right:
        return 0
    return int(round(100 * SequenceMatcher(None, left, right).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **_: object) -> float:
    """The first prediction line without a backtick, "#" or "//", compared with the gold: ratio / 100."""
    line = next(
        (
            candidate
            for candidate in prediction.lstrip("\n").split("\n")
            if "`" not in candidate and "#" not in candidate and "//" not in candidate
        ),
        "",
    )
    return fuzzy_ratio(line, ground_truth) / 100


# --------------------------------------------------------------------------------------------------
# synthetic tasks


def _em_normalize(text: str) -> str:
    return " ".join(text.casefold().split())


def is_no_answer(prediction: str) -> bool:
    """Whether a prediction says the fact is not in the document (``NO_ANSWER``, normalised as exact match)."""
    from maskkv_cli.prompting import NO_ANSWER

    return _em_normalize(first_line(prediction)) == _em_normalize(NO_ANSWER)


def exact_match(prediction: str, ground_truth: str, **_: object) -> float:
    """1.0 if the gold equals the prediction's first line or occurs in it as a whole token sequence.

    Both sides are stripped, casefolded and whitespace-collapsed first. An empty gold matches only an
    empty first line.
    """
    gold = _em_normalize(ground_truth)
    if _em_normalize(first_line(prediction)) == gold:
        return 1.0
    gold_tokens = _EM_TOKEN.findall(gold)
    if not gold_tokens:
        return 0.0
    tokens = _EM_TOKEN.findall(_em_normalize(prediction))
    size = len(gold_tokens)
    for start in range(len(tokens) - size + 1):
        if tokens[start : start + size] == gold_tokens:
            return 1.0
    return 0.0


# --------------------------------------------------------------------------------------------------
# per dataset

DATASET_METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1,
    "qasper": qa_f1,
    "multifieldqa_en": qa_f1,
    "multifieldqa_zh": qa_f1_zh,
    "hotpotqa": qa_f1,
    "2wikimqa": qa_f1,
    "musique": qa_f1,
    "dureader": rouge_l_zh,
    "gov_report": rouge_l,
    "qmsum": rouge_l,
    "multi_news": rouge_l,
    "vcsum": rouge_l_zh,
    "trec": classification_score,
    "triviaqa": qa_f1,
    "samsum": rouge_l,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
    **{kind: exact_match for kind in KINDS if kind != "lead_summary"},
    "lead_summary": rouge_l,
}

FIRST_LINE_DATASETS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def resolve_dataset(dataset: str) -> str:
    """The metric key for a dataset name; LongBench-E names (``hotpotqa_e``) map to their base task."""
    if dataset not in DATASET_METRIC and dataset.endswith("_e") and dataset[:-2] in DATASET_METRIC:
        return dataset[:-2]
    return dataset


def metric_for(dataset: str) -> Metric:
    """The metric used for a dataset; unknown datasets use ``exact_match``."""
    return DATASET_METRIC.get(resolve_dataset(dataset), exact_match)


def score(
    dataset: str,
    prediction: str,
    answers: Sequence[str],
    all_classes: Sequence[str] | None = None,
) -> float:
    """One sample's score: the best over the gold answers (0.0 when there are none)."""
    name = resolve_dataset(dataset)
    metric = DATASET_METRIC.get(name, exact_match)
    if name in FIRST_LINE_DATASETS:
        prediction = first_line(prediction)
    golds = (answers,) if isinstance(answers, str) else tuple(answers)
    best = 0.0
    for gold in golds:
        best = max(best, float(metric(prediction, gold, all_classes=all_classes)))
    return best


def aggregate(scores: Iterable[float]) -> float:
    """``round(100 * mean, 2)``; 0.0 for no scores."""
    values = [float(value) for value in scores]
    if not values:
        return 0.0
    return round(100 * sum(values) / len(values), 2)


def length_bin(length: int) -> str:
    """LongBench-E length bin of a record: "0-4k", "4-8k" or "8k+"."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


# ----- wrong answers of tasks with distractor needles -----------------------------------------------------------


def distractor_values(task: Task) -> set[str]:
    """The numbers of a task's distractor needles (generated niah_multikey, niah_none and open_question tasks; empty for
    other tasks and for records written before needles carried their value), so a wrong answer can be told apart:
    another needle's whole number (the wrong key matched) or something else (digits mixed from several needles, cut
    short)."""
    needles = task.meta.get("needles")
    if not isinstance(needles, list):
        return set()
    return {str(n["value"]) for n in needles
            if isinstance(n, dict) and n.get("role") == "distractor" and n.get("value") is not None}


def digit_mixing(prediction: str, answer: str, distractors: Iterable[str]) -> tuple[int, int]:
    """(places where the prediction's character differs from the answer's, of those the places where some
    distractor number has the predicted character at the same place), over the answer's length: how much of a
    wrong number was copied from the wrong needles."""
    others = list(distractors)
    wrong = borrowed = 0
    for place, (got, want) in enumerate(zip(prediction.strip(), answer, strict=False)):
        if got != want:
            wrong += 1
            borrowed += any(len(other) > place and other[place] == got for other in others)
    return wrong, borrowed
