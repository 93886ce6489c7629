"""Haystack sources, the no-answer and lead-summary tasks, and how training and the commands use them."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from maskkv_cli.bench.quality_sources import read_haystack
from maskkv_cli.errors import UsageError
from maskkv_cli.prompting import NO_ANSWER
from maskkv_cli.prompting.parts import LEAD_SENTENCES, SUMMARY_WORDS, lead_sentences, part_instruction
from maskkv_cli.tasks import sources
from maskkv_cli.tasks.metrics import DATASET_METRIC, is_no_answer, rouge_l, score
from maskkv_cli.tasks.synthetic import KEY_WORDS, NUM_DISTRACTORS, generate_tasks
from maskkv_cli.training.config import TrainConfig, parse_sources
from maskkv_cli.training.examples import Batcher, encode_example, summary_target, tokenizer_texts

EMBEDDED = Path(sources.__file__).parents[1] / "assets" / "tiny-llada"


def test_held_out_modules_are_chosen_by_name_only():
    names = [path.stem for path in sources._stdlib_files()]
    held = [n for n in names if sources.is_held_out_module(n)]
    assert 0.1 < len(held) / len(names) < 0.4  # about a quarter
    assert all(sources.is_held_out_module(n) == sources.is_held_out_module(n) for n in names)
    train, heldout = sources.load_source("stdlib-train"), sources.load_source("stdlib-heldout")
    # different modules; only docstrings that sibling modules copy (lzma / bz2 file methods) repeat across them
    shared = set(train) & set(heldout)
    assert train and heldout and len(shared) < 0.03 * len(set(heldout))


def test_held_out_text_is_from_held_out_modules_only():
    # configparser is held out (sha256("configparser")[0] < 64), os is not
    assert sources.is_held_out_module("configparser") and not sources.is_held_out_module("os")
    assert any(p.startswith("ConfigParser -- responsible for parsing") for p in sources.load_source("stdlib-heldout"))
    assert not any(p.startswith("ConfigParser -- responsible for parsing") for p in sources.load_source("stdlib-train"))


@pytest.mark.parametrize("name", sources.SOURCES)
def test_every_source_has_text_without_the_needle_phrase(name):
    try:
        paragraphs = sources.load_source(name)
    except ValueError as exc:
        # docs/ exists only in a source checkout, LICENSE.txt not in every Python build (Debian drops it)
        if name in ("docs", "license") and "has no text" in str(exc):
            pytest.skip(str(exc))
        raise
    assert len(paragraphs) > 5
    assert not any("special magic number" in p.lower() for p in paragraphs)


def test_pdf_source_reads_like_extracted_pdf_text():
    pages = sources.pdf_lines(("word " * 60 + "internationalization " * 3,) * 8, seed=0)
    assert pages[0][0] == "Python Library Notes" and pages[0][-1] == "Page 1"
    paragraphs = sources.load_source("pdf-heldout")
    assert not any("Python Library Notes" in p for p in paragraphs)  # repeated header dropped by the reader
    assert any(re.search(r"item\d \d", p) for p in paragraphs)  # tables of numbers


def test_unknown_source_and_haystack_by_name():
    with pytest.raises(ValueError, match="unknown haystack source"):
        sources.load_source("nope")
    paragraphs, source = read_haystack("stdlib-heldout")
    assert paragraphs == sources.load_source("stdlib-heldout")
    assert source.kind == "source" and source.name == "stdlib-heldout" and len(source.digest) == 64
    assert read_haystack("corpus") == (None, read_haystack("corpus")[1])
    assert read_haystack("corpus")[1].kind == "corpus"


def test_parse_sources():
    assert parse_sources("stdlib-train:2,corpus") == {"stdlib-train": 2.0, "corpus": 1.0}
    for bad in ("nope", "corpus:0", ""):
        with pytest.raises(UsageError):
            parse_sources(bad)


def test_no_answer_tasks_ask_for_a_key_that_is_not_there():
    for task in generate_tasks("niah_none", 5, 400, seed=3, haystack=sources.load_source("pydoc-topics")):
        key = re.fullmatch(r"What is the special magic number for ([a-z]+)\?", task.input).group(1)
        assert key in KEY_WORDS and f"number for {key} is" not in task.context
        assert task.answers == (NO_ANSWER,)
        assert len(task.meta["needles"]) == NUM_DISTRACTORS
        assert all(n["role"] == "distractor" and n["text"] in task.context for n in task.meta["needles"])
        assert score("niah_none", NO_ANSWER, task.answers) == 1.0
        assert score("niah_none", task.meta["needles"][0]["value"], task.answers) == 0.0


def test_open_questions_have_no_answer_in_the_text():
    tasks = generate_tasks("open_question", 40, 200, seed=4, haystack=sources.load_source("stdlib-train"))
    assert len({t.input for t in tasks}) > 30  # varied wording, not one question
    for task in tasks:
        assert "special magic number" not in task.input and task.input.strip()
        assert task.answers == (NO_ANSWER,)
        assert len(task.meta["needles"]) <= NUM_DISTRACTORS
        assert all(n["role"] == "distractor" and n["text"] in task.context for n in task.meta["needles"])
        assert score("open_question", NO_ANSWER, task.answers) == 1.0
    assert {len(t.meta["needles"]) for t in tasks} >= {0, NUM_DISTRACTORS}  # with and without needles
    again = generate_tasks("open_question", 40, 200, seed=4, haystack=sources.load_source("stdlib-train"))
    assert [t.input for t in again] == [t.input for t in tasks]


def test_tokenizer_texts_come_from_the_first_task_kinds_only():
    texts = tokenizer_texts(0)
    assert not any(NO_ANSWER in t or "Summarize the text" in t for t in texts)


def test_is_no_answer():
    assert is_no_answer(NO_ANSWER) and is_no_answer(f"  {NO_ANSWER.upper()} \nmore")
    assert not is_no_answer("12345") and not is_no_answer("")


def test_lead_sentences():
    text = "First one. Second? Yes!  Third\nline (wrapped). Fourth 4. e.g. lower stays."
    assert lead_sentences(text) == ["First one.", "Second?", "Yes!"]
    assert lead_sentences(text, 5) == ["First one.", "Second?", "Yes!", "Third line (wrapped).",
                                       "Fourth 4. e.g. lower stays."]
    assert lead_sentences("   ") == []


def test_lead_summary_tasks_use_summarize_instruction_and_the_lead():
    for task in generate_tasks("lead_summary", 4, 300, seed=2, haystack=sources.load_source("stdlib-train")):
        assert task.input in {part_instruction(w) for w in SUMMARY_WORDS}
        assert task.answers == (" ".join(lead_sentences(task.context, LEAD_SENTENCES)),)
        assert task.context.startswith(lead_sentences(task.context)[0][:20])
        assert task.meta["needles"] == []
    assert DATASET_METRIC["lead_summary"] is rouge_l


def test_summary_target_fits_whole_sentences(tiny_tokenizer):
    context = "Alpha beta gamma. Delta epsilon zeta eta. " + "Theta " * 50 + "end. Last one."
    ids = summary_target(tiny_tokenizer, context, 40)
    assert tiny_tokenizer.decode(ids) == "Alpha beta gamma. Delta epsilon zeta eta."
    cut = summary_target(tiny_tokenizer, "Theta " * 80 + "end.", 10)
    assert len(cut) == 10


def test_batches_mix_sources_and_give_summaries_their_own_region(tiny_tokenizer, tiny_config):
    cfg = TrainConfig(batch_size=4, min_len=60, max_len=80, answer_len=8, summary_len=24,
                      mix={"niah_single": 1.0, "niah_none": 1.0, "lead_summary": 1.0},
                      sources={"corpus": 1.0, "pydoc-topics": 1.0})
    batcher = Batcher(cfg, tiny_tokenizer, tiny_config)
    regions = set()
    rng = random.Random(0)
    for step in range(12):
        got = batcher.batch(step, rng)
        regions.add(got.rows.shape[1])
        assert got.summary == (got.rows.shape[1] == 24)  # picks --summary-full-mask for the batch
    assert regions == {8, 24}


def test_no_answer_fits_the_answer_region_of_the_embedded_model():
    from maskkv_cli.models.loading import read_config
    from maskkv_cli.prompting import load_tokenizer

    path = EMBEDDED
    tok = load_tokenizer(path)
    task = generate_tasks("niah_none", 1, 100, seed=0)[0]
    assert encode_example(tok, read_config(path), task, 8) is not None  # the answer and <|eot_id|> fit in 8


def test_embedded_model_declares_its_summary_length():
    from maskkv_cli.models.config import read_model_defaults

    defaults = read_model_defaults(EMBEDDED)
    assert defaults.summary_length == 64  # stage 23 and later write 64-token lead summaries (docs/tiny-model.md)
    assert defaults.generation["gen_length"] > 0
