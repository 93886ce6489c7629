"""Where ``bench quality``'s tasks come from (generated in the corpus or a haystack document, or read from a JSONL
file) and their prompts, encoded once per (task, length) cell as ``pipeline.prepare`` builds them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maskkv_cli.bench.quality_plan import DEFAULT_KINDS, DEFAULT_LENGTHS, DEFAULT_SAMPLES
from maskkv_cli.documents.corpus import split_paragraphs
from maskkv_cli.errors import UsageError
from maskkv_cli.tasks.synthetic import generate_tasks
from maskkv_cli.tasks.taskio import Task, load_jsonl

DOCUMENT_QUESTION = "document_question"  # the chat template around document + question (the synthetic tasks)


# ----- tasks -----------------------------------------------------------------------------------------------


@dataclass
class TaskGroup:
    """The tasks of one (task, length) cell with their prompt ids, shared by every case."""

    task: str  # a kind, or a dataset name for tasks read from a file
    length: int | None  # target context tokens; None for tasks read from a file (unless it was exported)
    tasks: list[Task]
    prompts: list[list[int]]
    truncated: int = 0  # prompts whose context was cut in its middle to fit the window
    gen_length: int | None = None  # the task's own answer length (LongBench), else the run's
    prompt_format: str = DOCUMENT_QUESTION  # how the prompts were built (see ``longbench.PromptSpec``)
    block_length: int | None = None  # the block length the model was trained to decode these answers in

    @property
    def n(self) -> int:
        return len(self.tasks)

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(len(p) for p in self.prompts) / len(self.prompts) if self.prompts else 0.0


@dataclass
class TaskSource:
    """Where the tasks come from, for the settings and the row keys."""

    kind: str  # "corpus", "haystack", "source" or "file"
    name: str  # file name, or "" for the corpus
    digest: str  # sha256 of the file's bytes (or "")

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "digest": self.digest}


def read_haystack(path: str | Path) -> tuple[list[str] | None, TaskSource]:
    """The paragraphs to hide needles in: a named source (``tasks/sources.py``: corpus, pydoc-topics,
    stdlib-train, stdlib-heldout, ...) unless a file of that name exists, else a user's document (PDF, text or
    Markdown). ``corpus`` gives None (the default haystack, so its rows are the default run's)."""
    from maskkv_cli.documents import load_document
    from maskkv_cli.errors import DocumentError
    from maskkv_cli.tasks.sources import SOURCES, load_source, source_digest

    name = str(path)
    if name in SOURCES and not Path(name).exists():
        if name == "corpus":
            return None, TaskSource("corpus", "", "")
        try:
            paragraphs = load_source(name)
        except ValueError as exc:
            raise UsageError(f"--haystack: {exc}") from None
        return paragraphs, TaskSource("source", name, source_digest(paragraphs))
    if not Path(name).expanduser().exists():
        raise UsageError(f"--haystack {name}: no such file, nor a named source ({', '.join(SOURCES)})")
    try:
        doc = load_document(path)
    except DocumentError as exc:
        if "password" in str(exc):  # (its words name --password, which bench quality does not take)
            raise UsageError(f"--haystack {name} is password-protected: bench takes no password; give it a "
                             "document it can read (a decrypted copy)") from None
        raise
    paragraphs = split_paragraphs(doc.text)
    if not paragraphs:
        raise UsageError(f"--haystack {path} contains no text")
    return paragraphs, TaskSource("haystack", Path(path).name, doc.sha256)


FileGroup = tuple[str, int | None, list[Task]]  # dataset, target length (exported synthetic tasks) or None, tasks


def read_tasks_file(path: str | Path, samples: int) -> tuple[list[FileGroup], TaskSource]:
    """Records of a JSONL file grouped by dataset (first-seen order), the first ``samples`` of each.

    Tasks exported by ``maskkv bench tasks`` carry their target length (``meta.target_length``) and are grouped
    by (dataset, length), so a file with several lengths gives the same cells as generating them here.
    """
    source = Path(path)
    if not source.is_file():
        raise UsageError(f"--tasks file {source} does not exist")
    try:
        tasks = load_jsonl(source)
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot read --tasks file {source}: {exc.strerror or exc}") from None
    if not tasks:
        raise UsageError(f"--tasks file {source} has no records")
    groups: dict[tuple[str, int | None], list[Task]] = {}
    for task in tasks:
        target = task.meta.get("target_length")
        cell = (task.dataset or source.stem, target if isinstance(target, int) and not isinstance(target, bool)
                else None)
        bucket = groups.setdefault(cell, [])
        if len(bucket) < samples:
            bucket.append(task)
    return [(name, length, bucket) for (name, length), bucket in groups.items()], TaskSource("file", source.name,
                                                                                              digest)


def encode_tasks(session: Any, tasks: Sequence[Task], gen_length: int) -> tuple[list[list[int]], int]:
    """Prompt ids of each task as ``pipeline.ask`` builds them (document then question, a context too long cut in
    its middle), and how many were cut."""
    from maskkv_cli.app.pipeline import prepare

    prepared = [prepare(session, task.context, task.input, gen_length) for task in tasks]
    return [p.ids for p in prepared], sum(p.fitted.dropped > 0 for p in prepared)


def build_groups(session: Any, *, kinds: Sequence[str] = DEFAULT_KINDS, lengths: Sequence[int] = DEFAULT_LENGTHS,
                 samples: int = DEFAULT_SAMPLES, seed: int = 0, gen_length: int = 16,
                 haystack: Sequence[str] | None = None,
                 file_groups: Sequence[FileGroup] | None = None,
                 templates: Mapping[str, str] | None = None, task_lengths: bool = True) -> list[TaskGroup]:
    """Generate (or take from a file) the tasks once and encode their prompts once.

    Datasets of a file that are LongBench tasks get the harness's prompts (``longbench.py``; ``templates``
    replaces the built-in wording) and, with ``task_lengths``, their own answer lengths instead of ``gen_length``.
    """
    from maskkv_cli.tasks.longbench import encode_longbench, prompt_spec

    if samples <= 0:
        raise UsageError(f"--samples must be a positive integer, got {samples}")
    groups: list[TaskGroup] = []
    if file_groups is not None:
        for name, target, tasks in file_groups:
            spec = prompt_spec(name, templates)
            if spec is None:
                prompts, cut = encode_tasks(session, tasks, gen_length)
                groups.append(TaskGroup(name, target, list(tasks), prompts, cut))
                continue
            length = spec.max_new_tokens if task_lengths else gen_length
            prompts, cut = encode_longbench(session, tasks, spec, length)
            groups.append(TaskGroup(name, target, list(tasks), prompts, cut,
                                    gen_length=length if task_lengths else None, prompt_format=spec.fingerprint))
        return groups
    for kind, length, tasks in generate_cells(kinds, lengths, samples, seed, haystack, session.count_tokens):
        # a lead summary is longer than a needle's answer: the length summarize generates for this model
        own = summary_length(session) if kind == "lead_summary" else None
        block = getattr(session, "summary_block", None) if kind == "lead_summary" else None
        prompts, cut = encode_tasks(session, tasks, own or gen_length)
        groups.append(TaskGroup(kind, length, tasks, prompts, cut, gen_length=own, block_length=block))
    return groups


def summary_length(session: Any) -> int:
    """Tokens of one lead summary: the model's ``summary_length`` (``generation_config.json``), else
    ``SUMMARY_TOKENS``."""
    from maskkv_cli.prompting.parts import SUMMARY_TOKENS

    return int(getattr(session, "summary_length", None) or SUMMARY_TOKENS)


def generate_cells(kinds: Sequence[str], lengths: Sequence[int], samples: int, seed: int,
                   haystack: Sequence[str] | None, count_tokens: Callable[[str], int]) -> list[FileGroup]:
    """The synthetic tasks of every (kind, length) cell, lengths counted with ``count_tokens``: the same for
    ``bench quality`` and ``bench tasks`` given the same seed and tokenizer."""
    cells: list[FileGroup] = []
    for kind in kinds:
        for length in lengths:
            try:
                tasks = generate_tasks(kind, samples, length, seed=seed,
                                       haystack=list(haystack) if haystack is not None else None,
                                       count_tokens=count_tokens)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            cells.append((kind, length, tasks))
    return cells
