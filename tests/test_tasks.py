"""Synthetic task generation and LongBench JSONL input/output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import maskkv_cli.tasks.synthetic as tasks_module
from maskkv_cli.documents.corpus import load_corpus, split_paragraphs
from maskkv_cli.tasks.synthetic import (
    KEY_WORDS,
    KINDS,
    PARAGRAPH_SEPARATOR,
    Task,
    count_words,
    generate_tasks,
)
from maskkv_cli.tasks.taskio import load_jsonl, save_jsonl


def _chars_over_four(text: str) -> int:
    return (len(text) + 3) // 4


def _resolve_vt(context: str) -> dict[str, str]:
    """Follow every VAR assignment in the context; returns name -> final numeric value."""
    direct: dict[str, str] = {}
    for name, source in re.findall(r"VAR ([A-Z]+) = (\w+)\.", context):
        direct[name] = source
    resolved: dict[str, str] = {}
    for name in direct:
        value = direct[name]
        seen = {name}
        while value in direct and value not in seen:
            seen.add(value)
            value = direct[value]
        resolved[name] = value
    return resolved


# --------------------------------------------------------------------------------------------------
# corpus


def test_corpus_is_large_plain_prose() -> None:
    paragraphs = load_corpus()
    text = "\n".join(paragraphs)
    assert len(paragraphs) > 100
    assert 60_000 <= len(text.encode("utf-8")) <= 110_000
    assert not re.search(r"\d", text)
    assert "magic number" not in text.lower()
    assert not re.search(r"\bVAR\b", text)
    assert all(paragraph == " ".join(paragraph.split()) for paragraph in paragraphs)
    assert load_corpus() == paragraphs  # a fresh, equal list each time
    assert load_corpus() is not paragraphs


def test_split_paragraphs() -> None:
    text = "First line\nstill first.\n\n\n  Second   one. \n \nThird"
    assert split_paragraphs(text) == ["First line still first.", "Second one.", "Third"]
    assert split_paragraphs("  \n\n ") == []


def test_key_words_are_simple_and_unique() -> None:
    assert len(set(KEY_WORDS)) == len(KEY_WORDS) >= 50
    assert all(re.fullmatch(r"[a-z]+", word) for word in KEY_WORDS)


# --------------------------------------------------------------------------------------------------
# generation


def test_kinds() -> None:
    assert KINDS == ("niah_single", "niah_multikey", "niah_multivalue", "vt", "niah_none", "lead_summary",
                     "open_question")


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_by_seed(kind: str) -> None:
    first = generate_tasks(kind, 3, 400, seed=11)
    again = generate_tasks(kind, 3, 400, seed=11)
    other = generate_tasks(kind, 3, 400, seed=12)
    assert first == again
    assert first != other
    assert [t.context for t in first] != [t.context for t in other]
    # Task i does not depend on how many tasks were asked for.
    assert generate_tasks(kind, 1, 400, seed=11)[0] == first[0]
    # Tasks of one call differ from each other.
    assert len({t.context for t in first}) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_needles_present_once_at_their_depth(kind: str) -> None:
    for task in generate_tasks(kind, 3, 1500, seed=5):
        needles = task.meta["needles"]
        needle_texts = {needle["text"] for needle in needles}
        assert len(needle_texts) == len(needles)
        pieces = task.context.split(PARAGRAPH_SEPARATOR)
        haystack_count = sum(1 for piece in pieces if piece not in needle_texts)
        assert haystack_count > 5
        for needle in needles:
            text, start = needle["text"], needle["start"]
            assert task.context.count(text) == 1
            assert task.context[start : start + len(text)] == text
            # Its own paragraph ...
            assert start == 0 or task.context[start - 2 : start] == PARAGRAPH_SEPARATOR
            end = start + len(text)
            assert end == len(task.context) or task.context[end : end + 2] == PARAGRAPH_SEPARATOR
            # ... after exactly depth * (haystack paragraphs) haystack paragraphs.
            before = task.context[:start].split(PARAGRAPH_SEPARATOR)[:-1] if start else []
            haystack_before = sum(1 for piece in before if piece not in needle_texts)
            assert haystack_before == pytest.approx(needle["depth"] * haystack_count)
            assert 0.0 <= needle["depth"] <= 1.0


def test_depths_spread_over_the_context() -> None:
    depths = [t.meta["needles"][0]["depth"] for t in generate_tasks("niah_single", 30, 800, seed=2)]
    assert min(depths) < 0.3
    assert max(depths) > 0.7


def test_niah_single_answer() -> None:
    for task in generate_tasks("niah_single", 5, 600, seed=1):
        match = re.fullmatch(r"What is the special magic number for ([a-z]+)\?", task.input)
        assert match is not None
        key = match.group(1)
        assert key in KEY_WORDS
        (answer,) = task.answers
        assert re.fullmatch(r"[1-9]\d{3,6}", answer)
        assert f"The special magic number for {key} is {answer}." in task.context
        assert len(re.findall(rf"\b{answer}\b", task.context)) == 1
        assert task.dataset == "niah_single"
        assert task.meta["key"] == key


def test_niah_multikey_answer_and_distractors() -> None:
    for task in generate_tasks("niah_multikey", 5, 800, seed=3):
        found = re.findall(r"The special magic number for ([a-z]+) is (\d+)\.", task.context)
        assert len(found) == 4
        keys = [key for key, _ in found]
        assert len(set(keys)) == 4
        values = dict(found)
        asked = task.meta["key"]
        assert task.input == f"What is the special magic number for {asked}?"
        assert task.answers == (values[asked],)
        assert len(set(values.values())) == 4
        roles = sorted(needle["role"] for needle in task.meta["needles"])
        assert roles == ["answer", "distractor", "distractor", "distractor"]


def test_niah_multikey_distractor_count() -> None:
    assert generate_tasks("niah_multikey", 3, 300, seed=2) == generate_tasks("niah_multikey", 3, 300, seed=2,
                                                                            distractors=3)
    for count in (0, 7):
        for task in generate_tasks("niah_multikey", 3, 600, seed=2, distractors=count):
            found = dict(re.findall(r"The special magic number for ([a-z]+) is (\d+)\.", task.context))
            assert len(found) == count + 1 and len(task.meta["distractor_keys"]) == count
            assert task.answers == (found[task.meta["key"]],)


def test_niah_multivalue_answers_in_order_of_appearance() -> None:
    for task in generate_tasks("niah_multivalue", 5, 800, seed=4):
        key = task.meta["key"]
        assert task.input == f"What are all the special magic numbers for {key}?"
        found = re.findall(rf"The special magic number for {key} is (\d+)\.", task.context)
        assert len(found) == 4
        assert len(set(found)) == 4
        assert task.answers == (", ".join(found),)


def test_vt_answer_follows_the_chain() -> None:
    for task in generate_tasks("vt", 5, 1000, seed=6):
        match = re.fullmatch(r"Which variables are assigned the value (\d+)\?", task.input)
        assert match is not None
        value = match.group(1)
        resolved = _resolve_vt(task.context)
        assert len(resolved) == 10  # one real chain and one distractor chain of five names
        holders = [name for name in resolved if resolved[name] == value]  # in order of appearance
        assert len(holders) == 5
        assert task.answers == (", ".join(holders),)
        assert f"VAR {holders[0]} = {value}." in task.context
        # The distractor chain carries a different value.
        assert len(set(resolved.values())) == 2


@pytest.mark.parametrize("length", [200, 1000, 5000])
@pytest.mark.parametrize("kind", KINDS)
def test_length_near_target_in_words(kind: str, length: int) -> None:
    for task in generate_tasks(kind, 2, length, seed=8):
        assert abs(count_words(task.context) - length) <= 0.1 * length
        assert task.length == count_words(task.context)
        assert task.meta["tokens"] == task.length
        assert task.meta["target_length"] == length


@pytest.mark.parametrize("length", [300, 3000])
def test_length_near_target_with_a_token_counter(length: int) -> None:
    for task in generate_tasks("niah_multikey", 3, length, seed=9, count_tokens=_chars_over_four):
        assert abs(_chars_over_four(task.context) - length) <= 0.1 * length
        assert task.meta["tokens"] == _chars_over_four(task.context)
        assert task.length == count_words(task.context)


def _words_and_newlines(text: str) -> int:
    """A tokenizer that spends one token on every newline (paragraph breaks cost two)."""
    return len(text.split()) + text.count("\n")


def test_length_budget_is_corrected_against_the_measured_context() -> None:
    # Paragraph breaks cost tokens only inside the assembled context; the budget must absorb them.
    for task in generate_tasks("vt", 3, 2000, seed=4, count_tokens=_words_and_newlines):
        assert abs(_words_and_newlines(task.context) - 2000) <= 20


def test_numbers_avoid_the_haystack_and_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks_module, "NUMBER_DIGITS", (4, 4))
    free = {"1111", "2222", "3333", "4444"}
    numbers = [str(value) for value in range(1000, 10000) if str(value) not in free]
    document = [" ".join(numbers[start : start + 100]) for start in range(0, len(numbers), 100)]
    for task in generate_tasks("niah_multivalue", 3, 300, seed=1, haystack=document):
        assert sorted(task.answers[0].split(", ")) == sorted(free)


def test_long_context_repeats_the_corpus() -> None:
    words = sum(count_words(p) for p in load_corpus())
    (task,) = generate_tasks("niah_single", 1, words + 2000, seed=0)
    assert abs(task.length - (words + 2000)) <= 0.1 * (words + 2000)
    assert task.meta["repeated"] is True
    (short,) = generate_tasks("niah_single", 1, 500, seed=0)
    assert short.meta["repeated"] is False


def test_user_haystack() -> None:
    document = [
        "The annual report of the Harbor Board lists 4821 ships and 1200 crew members.",
        "Chapter two explains the tides,\n with some   extra  spacing.",
        "",
        "A final page that mentions the code ABCDE and nothing else.",
    ]
    tasks = generate_tasks("niah_single", 4, 400, seed=3, haystack=document)
    for task in tasks:
        assert task.meta["haystack"] == "user"
        assert task.meta["repeated"] is True
        assert "Chapter two explains the tides, with some extra spacing." in task.context
        (answer,) = task.answers
        assert answer not in {"4821", "1200"}
        assert abs(task.length - 400) <= 40
        assert "The special magic number for" in task.context
    for task in generate_tasks("vt", 2, 400, seed=3, haystack=document):
        assert "ABCDE" not in task.answers[0].split(", ")
    assert generate_tasks("niah_single", 4, 400, seed=3, haystack=document) == tasks


def test_tiny_target_still_holds_the_needle() -> None:
    (task,) = generate_tasks("niah_single", 1, 3, seed=0)
    assert task.context == task.meta["needles"][0]["text"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "niah_nothing", "n": 1, "length": 100}, "unknown task kind"),
        ({"kind": "vt", "n": -1, "length": 100}, "number of tasks"),
        ({"kind": "vt", "n": 1, "length": 0}, "target length"),
        ({"kind": "vt", "n": 1, "length": 100, "haystack": ["  ", ""]}, "no text"),
        ({"kind": "niah_multikey", "n": 1, "length": 100, "distractors": -1}, "distractor needles"),
        ({"kind": "niah_multikey", "n": 1, "length": 100, "distractors": 1000}, "distractor needles"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate_tasks(seed=0, **kwargs)  # type: ignore[arg-type]


def test_zero_tasks() -> None:
    assert generate_tasks("vt", 0, 100, seed=0) == []


# --------------------------------------------------------------------------------------------------
# JSONL


def test_jsonl_round_trip(tmp_path: Path) -> None:
    tasks = [task for kind in KINDS for task in generate_tasks(kind, 2, 300, seed=1)]
    path = save_jsonl(tasks, tmp_path / "out" / "synthetic.jsonl")
    assert path == tmp_path / "out" / "synthetic.jsonl"
    assert load_jsonl(path) == tasks
    assert sorted(p.name for p in path.parent.iterdir()) == ["synthetic.jsonl"]  # no temporary left
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(tasks)
    record = json.loads(lines[0])
    for name in ("context", "input", "answers", "length", "dataset", "_id", "all_classes"):
        assert name in record
    assert record["all_classes"] is None
    assert record["answers"] == list(tasks[0].answers)
    assert record["dataset"] == "niah_single"
    assert isinstance(record["_id"], str) and len(record["_id"]) == 48
    assert len({json.loads(line)["_id"] for line in lines}) == len(tasks)


def test_save_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    good = generate_tasks("niah_single", 1, 100, seed=0)
    save_jsonl(good, path)
    before = path.read_bytes()
    broken = Task(context="c", input="q", answers=("a",), dataset="x", length=1, meta={"bad": object()})
    with pytest.raises(TypeError):
        save_jsonl(good + [broken], path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks.jsonl"]


def test_load_hand_written_longbench_records(tmp_path: Path) -> None:
    records = [
        {
            "input": "What type of question is this: Who wrote the letter?",
            "context": "Question: Where is the river? Type: Location",
            "answers": ["Human being"],
            "length": 7,
            "dataset": "trec",
            "language": "en",
            "all_classes": ["Location", "Human being", "Date"],
            "_id": "abc123",
            "pred": "ignored extra field",
        },
        {"context": "only the required fields here", "answers": ["x"]},
    ]
    path = tmp_path / "trec_e.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    first, second = load_jsonl(path)
    assert first.input == records[0]["input"]
    assert first.context == records[0]["context"]
    assert first.answers == ("Human being",)
    assert first.length == 7
    assert first.dataset == "trec"
    assert first.meta == {
        "_id": "abc123",
        "language": "en",
        "all_classes": ["Location", "Human being", "Date"],
    }
    assert second.input == ""
    assert second.length == 5  # words of the context
    assert second.dataset == "trec"  # from the file name, "_e" dropped
    assert second.meta == {}


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "JSON object"),
        ('{"context": "c"}', "answers"),
        ('{"answers": ["a"]}', "context"),
        ('{"context": "c", "answers": [["nested"]]}', "answers"),
        ('{"context": "c", "answers": ["a"], "length": "long"}', "length"),
    ],
)
def test_bad_line_names_its_number(tmp_path: Path, bad_line: str, message: str) -> None:
    good = json.dumps({"context": "c", "input": "q", "answers": ["a"]})
    path = tmp_path / "data.jsonl"
    path.write_text(f"{good}\n\n{bad_line}\n{good}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"line 3\b.*{message}"):
        load_jsonl(path)


def test_absent_key_twin_asks_the_same_text_about_a_key_with_no_needle():
    import random

    from maskkv_cli.prompting import NO_ANSWER
    from maskkv_cli.tasks.synthetic import absent_key_twin

    for task in generate_tasks("niah_multikey", 10, 200, seed=4) + generate_tasks("niah_single", 5, 200, seed=4):
        twin = absent_key_twin(task, random.Random(task.meta["index"]))
        assert twin.context == task.context and twin.answers == (NO_ANSWER,) and twin.dataset == "niah_none"
        assert twin.meta["key"] not in {n["text"].split(" for ")[1].split(" is ")[0] for n in task.meta["needles"]}
        assert twin.input == task.input.replace(task.meta["key"], twin.meta["key"])
        assert {n["role"] for n in twin.meta["needles"]} == {"distractor"}
        assert task.meta["key"] in twin.meta["distractor_keys"]
