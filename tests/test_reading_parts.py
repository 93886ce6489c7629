"""Reading a document longer than the window (issue 39): the parts, the choice among their answers, what each
answer says was read, and what kind of statement it is."""

from __future__ import annotations

import pytest

from maskkv_cli.app.pipeline import Answer, answer_row, choose_part, claim, parts_stats, spans_pages, trained_question
from maskkv_cli.prompting import NO_ANSWER
from maskkv_cli.prompting.fit import FittedContext, part_windows
from maskkv_cli.reports.answers import answer_line, cell_confidence, context_line
from maskkv_cli.runtime.stats import RunStats
from maskkv_cli.sampling.confidence import Confidence


def test_part_windows_cover_the_text_with_the_overlap_and_end_at_its_end() -> None:
    assert part_windows(50, 100, 10) == [(0, 50)]
    assert part_windows(100, 100, 10) == [(0, 100)]
    windows = part_windows(250, 100, 10)
    assert windows == [(0, 100), (90, 190), (150, 250)]
    for (_, end), (start, _) in zip(windows, windows[1:], strict=False):
        assert start <= end - 10  # every edge is inside the next part, with the overlap at least
    assert part_windows(250, 100, 0) == [(0, 100), (100, 200), (150, 250)]
    assert part_windows(10, 3, 99) == [(i, i + 3) for i in range(8)]  # an overlap as large as a part still moves
    with pytest.raises(Exception, match="no room for the document"):
        part_windows(10, 0, 0)


def fitted(span: tuple[int, int], chars: int = 1000, mode: str = "parts") -> FittedContext:
    return FittedContext("", 0, 0, 1, "", (span,), chars, source=(span,), mode=mode)


def stats(seconds: float = 1.0, kv: int = 10) -> RunStats:
    return RunStats("maskkv", 100, 8, steps_run=8, prefill_s=seconds / 2, step_s=[0.1] * 7, total_s=seconds,
                    kv_bytes=kv, kv_full_bytes=4 * kv, peak_mem_bytes=kv)


class Result:
    def __init__(self, seconds: float = 1.0, kv: int = 10) -> None:
        self.stats = stats(seconds, kv)


def part(text: str, low: float | None, span: tuple[int, int] = (0, 100)) -> Answer:
    conf = None if low is None else Confidence(mean=(1 + low) / 2, min=low, tokens=3)
    return Answer(text, 100, 16, Result(), [], conf, fitted(span))  # type: ignore[arg-type]


def test_the_most_confident_answering_part_wins_and_same_answers_join() -> None:
    parts = [part(NO_ANSWER, 0.99, (0, 100)), part("1320", 0.80, (90, 190)), part("4821", 0.97, (180, 280)),
             part("4821", 0.93, (270, 370)), part(NO_ANSWER, 1.0, (360, 460))]
    chosen, source = choose_part(parts)
    assert chosen is parts[2] and source == [parts[2], parts[3]]  # absence never beats an answer


def test_not_in_the_document_only_when_every_part_says_so() -> None:
    parts = [part(NO_ANSWER, 0.99), part(NO_ANSWER, 0.90), part(NO_ANSWER, 1.0)]
    chosen, source = choose_part(parts)
    assert chosen is parts[1] and source == parts  # the least sure of them speaks for all
    with_empty = [part(NO_ANSWER, 0.99), part("", None)]
    chosen, _ = choose_part(with_empty)
    assert chosen.text == ""  # a part that gave nothing is no "not in the document"
    low_guess = [part(NO_ANSWER, 1.0), part("77", 0.2)]
    assert choose_part(low_guess)[0].text == "77"  # a guess is shown (it will be marked LOW CONFIDENCE)


def test_an_answer_from_two_neighbouring_parts_comes_from_their_overlap() -> None:
    from maskkv_cli.app.pipeline import common_source

    assert common_source([(0, 100), (90, 190)]) == ((90, 100),)
    assert common_source([(0, 100)]) == ((0, 100),)
    assert common_source([(0, 100), (180, 280)]) == ((0, 100), (180, 280))  # far apart: each of them


def test_parts_stats_sum_the_work_and_keep_the_largest_cache() -> None:
    total = parts_stats([stats(1.0, 10), stats(2.0, 30)])
    assert total.total_s == 3.0 and total.steps_run == 16 and total.prompt_len == 200 and total.gen_length == 16
    assert total.kv_bytes == 30 and total.kv_full_bytes == 120 and len(total.step_s) == 14


@pytest.mark.parametrize("key", ["apple", "harbor", "zebra"])
def test_trained_question_is_the_generator_s_question_form(key: str) -> None:
    from maskkv_cli.tasks.synthetic import QUESTION_SINGLE

    assert trained_question(QUESTION_SINGLE.format(key=key))
    assert trained_question(f"  what is the special magic number for {key} ? ")


@pytest.mark.parametrize("question", ["Who wrote this specification?", "What number is mentioned for harbor?",
                                      "What is the special magic number for apple? And for pear?",
                                      "What are all the special magic numbers for apple?"])
def test_other_questions_are_not_of_the_trained_form(question: str) -> None:
    assert not trained_question(question)


def test_the_open_questions_the_model_was_trained_to_refuse_are_not_of_the_needle_form() -> None:
    import random

    from maskkv_cli.tasks.open_questions import open_question

    rng = random.Random(0)
    assert not any(trained_question(open_question(rng, "apple")) for _ in range(200))


Q = "What is the special magic number for apple?"


def with_read(answer: Answer, read: tuple[tuple[int, int], ...], mode: str, rope: int = 1) -> Answer:
    answer.fitted = FittedContext("", 0, 0, rope, "", read, 1000, source=read, mode=mode)
    return answer


def test_claims() -> None:
    whole = ((0, 1000),)
    cut = ((0, 300), (700, 1000))
    assert claim(with_read(part("4821", 0.99), whole, "whole"), Q, True) == "answer"
    assert claim(with_read(part(NO_ANSWER, 0.99), whole, "parts"), Q, True) == "absent"
    assert claim(with_read(part(NO_ANSWER, 0.99), cut, "truncate"), Q, True) == "absent-in-read"
    assert claim(with_read(part(NO_ANSWER, 0.99), whole, "rope-scale", rope=4), Q, True) == "absent-unverified"
    assert claim(with_read(part(NO_ANSWER, 0.99), whole, "whole"), Q, False) == "absent-unverified"
    assert claim(with_read(part(NO_ANSWER, 1.0), whole, "whole"), "Who wrote it?", True) == "untrained-question"
    assert claim(with_read(part("1999", 1.0), whole, "whole"), "Who wrote it?", True) == "untrained-question"
    assert claim(with_read(part("Ann", 1.0), whole, "whole"), "Who wrote it?", False) == "answer"
    assert claim(with_read(part("", None), whole, "whole"), Q, True) == "empty"


PAGES = [(1, 0, 250), (2, 252, 500), (3, 502, 750), (4, 752, 1000)]


def test_spans_map_to_the_pages_they_touch() -> None:
    assert spans_pages([(0, 1000)], PAGES) == [1, 2, 3, 4]
    assert spans_pages([(0, 300), (760, 1000)], PAGES) == [1, 2, 4]
    assert spans_pages([(251, 252)], PAGES) == []  # the separator between two pages
    assert spans_pages([(510, 520)], PAGES) == [3]


def row_of(answer: Answer, question: str = Q, embedded: bool = True) -> dict:
    answer.result.stats.as_dict = lambda: {}  # type: ignore[method-assign]
    return answer_row(answer, embedded, question, PAGES)


def test_a_cut_document_says_so_on_the_answer_line_and_never_claims_plain_absence() -> None:
    cut = ((0, 300), (760, 1000))
    found = row_of(with_read(part("4821", 0.99), cut, "truncate"))
    assert found["read"]["pages"] == [1, 2, 4] and found["read"]["pages_not_read"] == [3]
    assert found["read"]["complete"] is False
    assert answer_line(found) == ("4821 [read pages 1-2, 4 of 4; page 3 was cut (--long truncate; the default "
                                  "--long parts reads them all)]")
    absent = row_of(with_read(part(NO_ANSWER, 1.0), cut, "truncate"))
    assert absent["claim"] == "absent-in-read"
    assert answer_line(absent).startswith("not in the part read [read pages 1-2, 4 of 4; page 3 was cut")


def test_an_answer_read_in_parts_names_its_pages_and_the_parts() -> None:
    answer = part("4821", 0.99, (500, 760))
    answer.fitted = FittedContext("", 0, 0, 1, "", ((0, 1000),), 1000, parts=3, source=((500, 760),), mode="parts")
    row = row_of(answer)
    assert answer_line(row) == "4821"
    assert row["source"]["pages"] == [3, 4]
    assert context_line(row, "").endswith("; from pages 3-4 (read all 4 pages in 3 parts)")
    absent = part(NO_ANSWER, 0.99)
    absent.fitted = FittedContext("", 0, 0, 1, "", ((0, 1000),), 1000, parts=3, source=((0, 1000),), mode="parts")
    row = row_of(absent)
    assert answer_line(row) == NO_ANSWER
    assert context_line(row, "").endswith("; every one of the 3 parts says so (read all 4 pages)")


def test_the_embedded_model_asked_another_form_is_labelled_and_shows_no_confidence() -> None:
    row = row_of(with_read(part(NO_ANSWER, 1.0), ((0, 1000),), "whole"), "Who wrote this specification?")
    assert answer_line(row) is None  # its "not in the document" is not shown as an answer
    line = context_line(row, "")
    assert line.startswith("note: the embedded tiny model only answers questions of the form") and "1.00" not in line
    assert "maskkv pull GSAI-ML/LLaDA-8B-Instruct" in line
    assert cell_confidence(row) == "untrained question"
    guess = row_of(with_read(part("4821", 1.0), ((0, 1000),), "whole"), "What number is mentioned for harbor?")
    assert answer_line(guess).startswith("4821 [a guess:")


def test_rope_scaled_absence_is_qualified() -> None:
    row = row_of(with_read(part(NO_ANSWER, 1.0), ((0, 1000),), "rope-scale", rope=4))
    assert row["claim"] == "absent-unverified"
    assert answer_line(row).startswith("not in the document [read with the RoPE base scaled x4")
    # kept whole past the window with the factor 1 LongLLaDA's rule gives up to a few times it: a finding, it said
    unscaled = row_of(with_read(part(NO_ANSWER, 1.0), ((0, 1000),), "rope-scale", rope=1))
    assert unscaled["claim"] == "absent-unverified"
    assert answer_line(unscaled).startswith("not in the document [read beyond the window the model was trained on, "
                                            "its RoPE unscaled; --long parts reads it within the window]")


@pytest.mark.parametrize("which", ["embedded", "dgemma"])
def test_char_offsets_equal_the_prefix_decoding_in_one_pass(which: str) -> None:
    """The parts' character spans decoded each window's whole prefix: a book of 3.8M tokens spent minutes before
    its first part ran. ``char_offsets`` gives the same offsets (here at every position, characters of 1-4 bytes
    and spaces included) decoding each token a bounded number of times."""
    from maskkv_cli.prompting.chat import text_ids
    from maskkv_cli.prompting.fit import SEAM_TOKENS, char_offset, char_offsets

    if which == "embedded":
        from maskkv_cli.models.catalog import shipped_model
        from maskkv_cli.prompting.chat import load_tokenizer

        tokenizer = load_tokenizer(shipped_model())
    else:
        from dgemma_folder import tokenizer as dgemma_tokenizer

        tokenizer = dgemma_tokenizer()
    text = ("The café's crème brûlée costs 4,821 ¥ — naïve  façade.\n\n港口 灰色 🚂 left at noon; "
            "Grüße aus Köln!  The special magic number for lemon is 7123.\t ") * 3
    ids = text_ids(tokenizer, text)
    every = list(range(len(ids) + 1))
    assert char_offsets(tokenizer, ids, every, text) == [char_offset(tokenizer, ids, at, text) for at in every]

    decoded: list[int] = []
    real = tokenizer.decode

    class Counting:
        def decode(self, tokens: list[int]) -> str:
            decoded.append(len(tokens))
            return real(tokens)

    long_text = text * 8
    ids = text_ids(tokenizer, long_text)
    bounds = [start for start, _ in part_windows(len(ids), 40, 10)]
    assert char_offsets(Counting(), ids, bounds, long_text) == [char_offset(tokenizer, ids, at, long_text)
                                                                for at in bounds]
    # each token decoded a few times (a boundary inside a character decodes its prefix again), not once per window
    assert sum(decoded) <= 3 * len(ids) + 4 * SEAM_TOKENS * len(bounds), (sum(decoded), len(ids), len(bounds))


def test_the_pages_total_counts_the_blank_pages_between() -> None:
    """A PDF whose even pages are blank: "read pages 1, 59 of 30" counted the pages with text only."""
    from maskkv_cli.app.pipeline import add_pages

    pages = [(n, 10 * i, 10 * i + 10) for i, n in enumerate(range(1, 60, 2))]  # pages 1, 3, ..., 59 hold text
    row = {"read": {"spans": [[0, 10], [290, 300]]}, "source": {"spans": [[0, 10]]}}
    add_pages(row, pages)
    assert row["read"]["pages"] == [1, 59] and row["read"]["pages_total"] == 59


def test_a_low_confidence_never_reads_as_the_cut_in_a_cell() -> None:
    """summary.md's cell and profile's column rounded 0.9453 to "0.95" beside LOW, while the answer's own line
    said 0.94."""
    from maskkv_cli.cli.render_profile import confidence_cell

    low = {"confidence": Confidence(mean=0.968, min=0.9453, tokens=4).as_dict()}
    assert low["confidence"]["low"]
    assert cell_confidence(low) == "LOW 0.96 / 0.94"
    assert confidence_cell(low).plain == "LOW 0.94"
    assert "min 0.94 over 4 tokens" in context_line(low | {"claim": "answer"}, "")
    sure = {"confidence": Confidence(mean=0.999, min=0.987, tokens=4).as_dict()}
    assert cell_confidence(sure) == "1.00 / 0.99" and confidence_cell(sure).plain == "0.99"
