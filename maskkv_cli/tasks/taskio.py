"""The task record (one question over one context) and tasks as LongBench JSONL records (``context``, ``input``,
``answers``, ``length``, ``dataset``, ``_id``; our own fields under ``meta``): what ``bench tasks`` writes and
``bench quality --tasks FILE`` reads."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maskkv_cli.runtime.fileio import atomic_write_text

__all__ = ["Task", "count_words", "load_jsonl", "record_to_task", "save_jsonl", "task_to_record"]

_ID_CHARS = 48
_TOP_LEVEL_META = ("_id", "language", "all_classes")


@dataclass(frozen=True)
class Task:
    """One question over one context, in the shape of a LongBench record."""

    context: str
    input: str
    answers: tuple[str, ...]
    dataset: str
    length: int  # whitespace words in ``context`` (LongBench's convention)
    meta: dict[str, Any] = field(default_factory=dict, hash=False)


def count_words(text: str) -> int:
    """Default length measure: whitespace-separated words."""
    return len(text.split())


def task_id(dataset: str, question: str, context: str) -> str:
    """A task's ``_id``: a hash of its dataset, question and context (the same task gets the same id)."""
    digest = hashlib.sha256(f"{dataset}\x00{question}\x00{context}".encode()).hexdigest()
    return digest[:_ID_CHARS]


def task_to_record(task: Task) -> dict[str, Any]:
    """The LongBench record for a task; meta keys other than _id/language/all_classes go under "meta"."""
    record: dict[str, Any] = {
        "input": task.input,
        "context": task.context,
        "answers": list(task.answers),
        "length": task.length,
        "dataset": task.dataset,
    }
    if "language" in task.meta:
        record["language"] = task.meta["language"]
    record["all_classes"] = task.meta.get("all_classes")
    record["_id"] = task.meta.get("_id") or task_id(task.dataset, task.input, task.context)
    rest = {key: value for key, value in task.meta.items() if key not in _TOP_LEVEL_META}
    if rest:
        record["meta"] = rest
    return record


def save_jsonl(tasks: Iterable[Task], path: str | os.PathLike[str]) -> Path:
    """Write tasks as LongBench JSONL, atomically (a temporary file in the same folder, then rename), readable by
    everyone (0o644) like an export."""
    text = "".join(json.dumps(task_to_record(task), ensure_ascii=False) + "\n" for task in tasks)
    return atomic_write_text(path, text, mode=0o644)


def _as_text_list(value: object, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError(f'"{name}" must be a list of strings')
    items: list[str] = []
    for item in value:
        if isinstance(item, str):
            items.append(item)
        elif isinstance(item, int | float) and not isinstance(item, bool):
            items.append(str(item))
        else:
            raise ValueError(f'"{name}" must be a list of strings')
    return items


def record_to_task(record: object, default_dataset: str = "") -> Task:
    """A Task from one LongBench record; unknown fields are ignored, optional ones may be missing."""
    if not isinstance(record, dict):
        raise ValueError("a record must be a JSON object")
    context = record.get("context")
    if not isinstance(context, str):
        raise ValueError('"context" is missing or not a string')
    question = record.get("input")
    if question is None:
        question = ""
    if not isinstance(question, str):
        raise ValueError('"input" must be a string')
    if "answers" not in record:
        raise ValueError('"answers" is missing')
    answers = tuple(_as_text_list(record["answers"], "answers"))
    length = record.get("length")
    if length is None:
        length = count_words(context)
    elif isinstance(length, float) and length.is_integer():
        length = int(length)
    if not isinstance(length, int) or isinstance(length, bool):
        raise ValueError('"length" must be an integer')
    dataset = record.get("dataset")
    if dataset is None:
        dataset = default_dataset
    if not isinstance(dataset, str):
        raise ValueError('"dataset" must be a string')

    meta: dict[str, Any] = {}
    extra = record.get("meta")
    if isinstance(extra, dict):
        meta.update(extra)
    if record.get("_id") is not None:
        meta["_id"] = str(record["_id"])
    if isinstance(record.get("language"), str):
        meta["language"] = record["language"]
    if record.get("all_classes") is not None:
        meta["all_classes"] = _as_text_list(record["all_classes"], "all_classes")
    return Task(context=context, input=question, answers=answers, dataset=dataset, length=length, meta=meta)


def _dataset_from_path(path: Path) -> str:
    stem = path.name.removesuffix(".jsonl")
    return stem.removesuffix("_e")


def load_jsonl(path: str | os.PathLike[str]) -> list[Task]:
    """Read LongBench JSONL (blank lines skipped); a bad line raises ValueError naming its number.

    A record without "dataset" takes the file name (``hotpotqa_e.jsonl`` -> ``hotpotqa``).
    """
    source = Path(path)
    default_dataset = _dataset_from_path(source)
    tasks: list[Task] = []
    with source.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            where = f"{source}, line {line_number}"
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: not UTF-8 text ({error.reason})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: invalid JSON ({error.msg})") from None
            try:
                tasks.append(record_to_task(record, default_dataset))
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
    return tasks
