"""LongBench metrics and exact match, against hand-computed values."""

from __future__ import annotations

import pytest

from maskkv_cli.tasks.metrics import (
    DATASET_METRIC,
    aggregate,
    classification_score,
    code_sim_score,
    count_score,
    exact_match,
    first_line,
    fuzzy_ratio,
    length_bin,
    metric_for,
    normalize_answer,
    normalize_zh_answer,
    qa_f1,
    qa_f1_zh,
    retrieval_score,
    retrieval_zh_score,
    rouge_l,
    rouge_l_zh,
    score,
)
from maskkv_cli.tasks.synthetic import KINDS

LONGBENCH_DATASETS = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
    "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p",
)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# normalisation and QA F1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Cat, a dog & AN apple!", "cat dog apple"),
        ("  Hello,\n\tWorld.  ", "hello world"),
        ("theatre another", "theatre another"),  # articles only as whole words
        ("a-n", ""),  # punctuation goes first, which leaves the article "an"
        ("the", ""),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_qa_f1_hand_values() -> None:
    # prediction tokens: cat sat on mat; gold: cat on mat -> p = 3/4, r = 1
    assert qa_f1("The cat sat on the mat.", "a cat on a mat") == pytest.approx(6 / 7)
    # multiset overlap: y twice -> p = 2/4, r = 2/3
    assert qa_f1("x y y y", "y y z") == pytest.approx(4 / 7)
    assert qa_f1("Paris", "paris!") == 1.0
    assert qa_f1("London", "Paris") == 0.0


def test_qa_f1_empty_scores_zero() -> None:
    assert qa_f1("", "") == 0.0
    assert qa_f1("the", "a") == 0.0  # both normalise to nothing
    assert qa_f1("", "Paris") == 0.0
    assert qa_f1("Paris", "") == 0.0


def test_qa_f1_zh() -> None:
    assert normalize_zh_answer("北京 ，Ab！") == "北京ab"
    assert qa_f1_zh("北京。", "北京") == 1.0
    assert qa_f1_zh("北京市", "北京") == pytest.approx(0.8)  # p = 2/3, r = 1
    assert qa_f1_zh("。", "") == 0.0


# --------------------------------------------------------------------------------------------------
# ROUGE-L


def test_rouge_l_summary_level_hand_value() -> None:
    # Distinct reference words: the cat was on mat it sat (7); prediction: the cat sat on mat (5).
    # Union of LCS words over sentence pairs: {the, cat} | {on, the, mat} | {sat} -> 5.
    # r = 5/7, p = 5/5 -> F = 2 * (5/7) / (12/7) = 10/12.
    value = rouge_l("the cat sat. on the mat", "the cat was on the mat. it sat")
    assert value == pytest.approx(10 / 12, abs=1e-6)


def test_rouge_l_no_lowercasing_and_identity() -> None:
    assert rouge_l("Hello world", "hello world") == pytest.approx(0.5, abs=1e-6)
    assert rouge_l("a b c", "a b c") == pytest.approx(1.0, abs=1e-6)
    assert rouge_l("c b a", "a b c") == pytest.approx(1 / 3, abs=1e-6)


def test_rouge_l_empty_scores_zero() -> None:
    assert rouge_l("", "a reference") == 0.0
    assert rouge_l("...", "a reference") == 0.0  # only separators: no sentence at all
    assert rouge_l("a prediction", "") == 0.0
    assert rouge_l("completely different", "nothing shared here") == 0.0


def test_rouge_l_zh_is_character_level() -> None:
    # chars 我 爱 北 京 vs 我 爱 上 海: LCS {我, 爱} -> r = p = 1/2
    assert rouge_l_zh("我爱北京", "我爱上海") == pytest.approx(0.5, abs=1e-6)


# --------------------------------------------------------------------------------------------------
# classification, retrieval, count, code


def test_classification_score() -> None:
    classes = ["Location", "City", "Country", "Date"]
    assert classification_score("City", "City", all_classes=classes) == 1.0
    assert classification_score("City and Country", "City", all_classes=classes) == 0.5
    assert classification_score("Date", "City", all_classes=classes) == 0.0
    assert classification_score("no class here", "City", all_classes=classes) == 0.0


def test_classification_drops_substrings_of_the_gold() -> None:
    classes = ["number", "phone number", "date"]
    # "number" is inside the gold but not equal to it: dropped, so the gold is the only match.
    assert classification_score("phone number", "phone number", all_classes=classes) == 1.0
    # Not dropped when the gold is something else.
    assert classification_score("phone number", "number", all_classes=classes) == 0.5


def test_classification_keeps_the_official_skip_after_drop() -> None:
    # Matches [num, number, phone number]: "num" is dropped, then the walk moves on past "number"
    # (now at the dropped one's place), so "number" stays: two matches -> 1/2.
    classes = ["num", "number", "phone number"]
    assert classification_score("phone number", "phone number", all_classes=classes) == 0.5


def test_classification_needs_classes() -> None:
    with pytest.raises(ValueError, match="all_classes"):
        classification_score("City", "City")


def test_retrieval_score() -> None:
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert retrieval_score("Paragraph 120", "Paragraph 12") == 0.0
    assert retrieval_score("I do not know", "Paragraph 12") == 0.0
    assert retrieval_score("12", "12") == 1.0  # gold without the pattern: its first number
    assert retrieval_zh_score("答案是段落5", "段落5") == 1.0
    assert retrieval_zh_score("段落5和段落6", "段落5") == 0.5
    with pytest.raises(ValueError):
        retrieval_score("Paragraph 1", "no number")


def test_count_score() -> None:
    assert count_score("7", "7") == 1.0
    assert count_score("There are 7 unique paragraphs out of 12", "7") == 0.5
    assert count_score("seventy", "7") == 0.0
    assert count_score("77", "7") == 0.0


def test_fuzzy_ratio() -> None:
    assert fuzzy_ratio("abcd", "abce") == 75  # 2 * 3 / 8
    assert fuzzy_ratio("ab", "abc") == 80  # 2 * 2 / 5
    assert fuzzy_ratio("abc", "xyz") == 0
    assert fuzzy_ratio("", "") == 100
    assert fuzzy_ratio("", "a") == 0
    assert fuzzy_ratio("abc", "abcdefg") == 60  # 2 * 3 / 10
    assert fuzzy_ratio("abc", "abd") == 67  # 2 * 2 / 6 = 66.67, rounded


def test_code_sim_score() -> None:
    prediction = "\n\n```python\n# the next line\nx = foo(1)\nreturn x\n"
    assert code_sim_score(prediction, "x = foo(1)") == 1.0
    assert code_sim_score("// comment\nabcd", "abce") == 0.75
    assert code_sim_score("# only\n`comments`", "abc") == 0.0  # no usable line
    assert code_sim_score("", "") == 1.0


# --------------------------------------------------------------------------------------------------
# exact match


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("12345", "12345", 1.0),
        ("The special magic number for apple is 12345.", "12345", 1.0),
        ("It is 123456.", "12345", 0.0),  # not a whole word
        ("It is 512345", "12345", 0.0),
        ("  HELLO   World ", "hello world", 1.0),  # strip, casefold, collapse whitespace
        ("hello\nworld", "hello world", 1.0),  # whitespace across lines collapses too
        ("say hello worldwide", "hello world", 0.0),
        ("First line\nThe answer: ABCDE, FGHIJ", "abcde, fghij", 1.0),
        ("12, 34", "12, 34", 1.0),
        ("They are 12,34.", "12, 34", 1.0),  # punctuation marks are tokens of their own
        ("12 and 34", "12, 34", 0.0),
        ("", "", 1.0),  # an empty gold matches only an empty first line
        ("\n\nsomething", "", 0.0),
        ("", "12345", 0.0),
        ("\n\n  Straße  \nmore", "STRASSE", 1.0),  # casefold, first line after leading newlines
    ],
)
def test_exact_match(prediction: str, gold: str, expected: float) -> None:
    assert exact_match(prediction, gold) == expected


def test_first_line() -> None:
    assert first_line("\n\nParis\nLondon") == "Paris"
    assert first_line("") == ""
    assert first_line("  a  \nb") == "  a  "


# --------------------------------------------------------------------------------------------------
# per dataset


def test_dataset_metric_covers_longbench_and_synthetic_kinds() -> None:
    for name in LONGBENCH_DATASETS:
        assert name in DATASET_METRIC
    for kind in KINDS:
        assert DATASET_METRIC[kind] is (rouge_l if kind == "lead_summary" else exact_match)
    assert DATASET_METRIC["hotpotqa"] is qa_f1
    assert DATASET_METRIC["gov_report"] is rouge_l
    assert DATASET_METRIC["trec"] is classification_score
    assert DATASET_METRIC["passage_count"] is count_score
    assert DATASET_METRIC["lcc"] is code_sim_score
    assert metric_for("hotpotqa_e") is qa_f1
    assert metric_for("my_own_task") is exact_match


def test_score_first_line_rule() -> None:
    prediction = "Paris\nLondon is the capital"
    assert score("triviaqa", prediction, ["London"]) == 0.0  # only "Paris" is scored
    # hotpotqa scores everything: tokens paris london is capital -> p = 1/4, r = 1 -> 0.4
    assert score("hotpotqa", prediction, ["London"]) == pytest.approx(0.4)


def test_score_max_over_answers_and_fallbacks() -> None:
    assert score("hotpotqa", "the cat", ["dog", "a cat", "cat sat"]) == 1.0
    assert score("hotpotqa", "cat", ["dog", "cat sat"]) == pytest.approx(2 / 3)
    assert score("niah_single", "The number is 4321.", ["4321"]) == 1.0
    assert score("unknown_set", "The number is 4321.", ["4321"]) == 1.0  # exact match
    assert score("unknown_set", "4321", []) == 0.0
    assert score("hotpotqa_e", "cat", ["cat"]) == 1.0
    classes = ["Location", "City"]
    assert score("trec", "City\nLocation", ["City"], all_classes=classes) == 1.0
    assert score("trec", "Location City", ["City"], all_classes=classes) == 0.5
    assert score("vt", "ABCDE, FGHIJ", "ABCDE, FGHIJ") == 1.0  # a lone string is one answer


def test_aggregate() -> None:
    assert aggregate([1.0, 0.0, 0.5]) == 50.0
    assert aggregate([1 / 3]) == 33.33
    assert aggregate([2 / 3, 1 / 3, 1 / 3]) == 44.44
    assert aggregate(x for x in [1.0, 1.0]) == 100.0
    assert aggregate([]) == 0.0


def test_length_bin() -> None:
    assert length_bin(3999) == "0-4k"
    assert length_bin(4000) == "4-8k"
    assert length_bin(8000) == "8k+"
