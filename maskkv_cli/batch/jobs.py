"""What a batch run does: jobs (a document and a question, with optional per-job settings) and their keys.

Jobs come from a JSONL or CSV file of rows with ``document`` and ``question`` (optional ``id``, ``policy``,
``budget``, ``gen_length``), or from the cross product of a glob of documents and a file of questions. A job's
key hashes the document's content, the question, the model and every setting that changes the answer, so a
rerun into the same results folder can skip what is finished whatever the order or the file names.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import io
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from maskkv_cli.errors import UsageError, reason
from maskkv_cli.prompting.fit import DEFAULT_LONG

JOB_FIELDS = ("id", "document", "question", "policy", "budget", "gen_length")
LATER_FIELDS = ("editing_threshold", "max_post_steps")  # in a job's key only when set (``key_fields``)


@dataclass(frozen=True)
class AnswerSettings:
    """Everything besides the document, the question and the model that decides an answer."""

    policy: str
    budget: int | None = None
    ratio: float | None = None
    layer_budgets: str = "auto"
    gen_length: int | None = None  # None: the model's default (resolved before keys are made)
    steps: int | None = None
    block_length: int | None = None
    temperature: float = 0.0
    threshold: float | None = None
    seed: int = 0
    long: str = DEFAULT_LONG  # as ask: a document longer than the window is read in parts
    alg: str = "entropy"  # Dream only
    top_p: float | None = None  # Dream and LLaDA2
    top_k: int | None = None  # Dream and LLaDA2
    editing_threshold: float | None = None  # LLaDA2.1 (None: the model's stored default)
    max_post_steps: int | None = None  # LLaDA2.1 (None: the model's stored default)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def key_fields(self) -> dict[str, Any]:
        """What a job's key hashes: every field, less the LLaDA2 options left at the model's defaults (so the keys
        of runs made before those options existed stay the same, and so do their finished rows)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k not in LATER_FIELDS}


@dataclass(frozen=True)
class JobSpec:
    """One row of the input: a document path and a question, with optional per-job overrides."""

    id: str
    document: str
    question: str
    policy: str | None = None
    budget: int | None = None
    gen_length: int | None = None


@dataclass(frozen=True)
class Job:
    """A planned job: its spec resolved against the run's settings and the document's content hash."""

    key: str
    id: str
    document: str  # the path as given
    document_sha: str  # "" when the document could not be read
    question: str
    settings: AnswerSettings
    extra: dict[str, Any] = field(default_factory=dict)

    def message(self) -> dict[str, Any]:
        """What a worker needs (plain data, picklable, no paths it would have to read)."""
        return {"key": self.key, "id": self.id, "question": self.question, "settings": self.settings.as_dict()}


AUTO_GROUP = 16  # jobs sent to a worker at once under --batch-size auto (the worker sizes its batch by memory)


@dataclass(frozen=True)
class JobGroup:
    """Jobs of equal settings that one worker answers together (``answering.answer_jobs``: their prompts denoised
    up to ``batch_size`` at a time, each answer the one it gets alone); None: the worker picks by memory."""

    jobs: tuple[Job, ...]
    batch_size: int | None

    @property
    def key(self) -> str:
        return "+".join(job.key for job in self.jobs)

    @property
    def document_sha(self) -> str:
        """What a worker keeps of its texts, by which it is sent them again only when this changes: its documents'
        hashes, marked as a group's (a group's texts are a dict by hash, a job's one string: a job retried alone
        after its group, on the same document, must not be taken for the group's texts)."""
        return "group:" + "+".join(dict.fromkeys(job.document_sha for job in self.jobs))

    def message(self) -> dict[str, Any]:
        return {"kind": "group", "key": self.key, "batch_size": self.batch_size,
                "jobs": [{**job.message(), "document_sha": job.document_sha} for job in self.jobs]}


Unit = Job | JobGroup  # what a worker is sent at once


def group_jobs(jobs: list[Job], batch_size: int | None) -> list[Unit]:
    """Consecutive jobs (in the given order: one document after another) with equal settings in groups of
    ``batch_size`` (``AUTO_GROUP`` when None); a batch size of 1 leaves the jobs as they are."""
    if batch_size == 1:
        return list(jobs)
    size = batch_size or AUTO_GROUP
    units: list[Unit] = []
    current: list[Job] = []
    for job in jobs:
        if current and (len(current) == size or job.settings != current[0].settings):
            units.append(JobGroup(tuple(current), batch_size))
            current = []
        current.append(job)
    if current:
        units.append(JobGroup(tuple(current), batch_size))
    return units


def unit_text(unit: Unit, texts: dict[str, str]) -> Any:
    """What a worker needs besides the message: a job's document text, a group's texts by hash."""
    if isinstance(unit, JobGroup):
        return {job.document_sha: texts[job.document_sha] for job in unit.jobs}
    return texts[unit.document_sha]


def _positive_int(value: Any, name: str, where: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        number = int(str(value).strip())
    except ValueError:
        raise UsageError(f"{where}: {name} must be a whole number, got {value!r}") from None
    if number <= 0:
        raise UsageError(f"{where}: {name} must be positive, got {number}")
    return number


def _spec(row: dict[str, Any], where: str, default_id: str, base: Path) -> JobSpec:
    unknown = sorted(set(row) - set(JOB_FIELDS))
    if unknown:
        raise UsageError(f"{where}: unknown column(s) {', '.join(unknown)}; allowed: {', '.join(JOB_FIELDS)}")
    document = str(row.get("document") or "").strip()
    question = str(row.get("question") or "").strip()
    if not document or not question:
        raise UsageError(f"{where}: every job needs a document and a question")
    path = Path(document).expanduser()
    if not path.is_absolute():
        path = base / path  # relative to the jobs file, like paths in a playlist
    policy = str(row.get("policy") or "").strip() or None
    if policy is not None:
        from maskkv_cli.policies.base import check_policy

        check_policy(policy, f"{where}: ")
    given = row.get("id")  # (an id of 0 is an id: ``or`` took it for none)
    job_id = ("" if given is None else str(given)).strip() or default_id
    return JobSpec(id=job_id, document=str(path), question=question,
                   policy=policy, budget=_positive_int(row.get("budget"), "budget", where),
                   gen_length=_positive_int(row.get("gen_length"), "gen_length", where))


def _read_list(path: Path, what: str, on_note: Callable[[str], None] | None) -> str:
    """The text of a questions or jobs file, decoded as documents are (UTF-8, else UTF-16 with its marker,
    Windows-1252 or Latin-1 with a note to ``on_note``)."""
    from maskkv_cli.documents.text import decode_text
    from maskkv_cli.errors import DocumentError

    try:
        text, notes = decode_text(path.read_bytes(), str(path))
    except (OSError, DocumentError) as exc:
        raise UsageError(f"cannot read the {what} {path}: {reason(exc)}") from None
    for message in notes:
        if on_note is not None:
            on_note(message)
    return text


def read_jobs_file(path: Path, on_note: Callable[[str], None] | None = None) -> list[JobSpec]:
    """Jobs from a ``.jsonl`` (one object per line) or ``.csv`` (a header row) file; ``on_note`` hears how a file
    that is not UTF-8 was read."""
    text = _read_list(path, "jobs file", on_note)
    base = path.resolve().parent
    specs: list[JobSpec] = []
    wheres: list[str] = []  # where each job is in the file
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))  # a quoted field may hold line breaks
        if not reader.fieldnames or not {"document", "question"} <= {f.strip() for f in reader.fieldnames}:
            raise UsageError(f"{path}: the CSV header must name at least the columns document and question")
        for n, row in enumerate(reader, 1):
            if row.get(None):  # csv's key for the fields past the header's: a comma in a field not quoted
                raise UsageError(f"{path}:{reader.line_num}: {len(reader.fieldnames) + len(row[None])} fields for "
                                 f"{len(reader.fieldnames)} columns; put a field that holds a comma in double quotes")
            clean = {str(k).strip(): v for k, v in row.items() if k is not None}
            wheres.append(f"{path}:{reader.line_num}")
            specs.append(_spec(clean, wheres[-1], str(n), base))
    else:
        # lines end at "\n" only: str.splitlines would also cut at U+2028, U+0085 and the like, which JSON strings
        # may hold as they are
        for n, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                hint = "" if path.suffix.lower() in (".jsonl", ".json", ".ndjson") else (
                    f" (a jobs file is .jsonl or .csv; to ask about documents: --docs {path} --questions FILE)")
                raise UsageError(f"{path}:{n}: not a JSON object ({exc.msg}); one job per line{hint}") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path}:{n}: not a JSON object; one job per line")
            wheres.append(f"{path}:{n}")
            specs.append(_spec(row, wheres[-1], str(n), base))
    if not specs:
        raise UsageError(f"{path} holds no jobs")
    _unique_ids(specs, wheres)
    return specs


def _unique_ids(specs: list[JobSpec], wheres: list[str]) -> None:
    """Refuse a jobs file in which two jobs have one id: the id names a job's row in the results and in
    ``summary.md``, and which answer is whose would be lost."""
    first: dict[str, str] = {}
    for spec, where in zip(specs, wheres, strict=True):
        if spec.id in first:
            raise UsageError(f"{where}: the id {spec.id!r} is also the id of the job at {first[spec.id]}; give "
                             "each job its own id (or leave the ids out: a job is then named by its line)")
        first[spec.id] = where


def read_questions(path: Path, on_note: Callable[[str], None] | None = None) -> list[str]:
    """One question per line; blank lines and lines starting with # are skipped; ``on_note`` hears how a file that
    is not UTF-8 was read."""
    text = _read_list(path, "questions file", on_note)
    questions = [line.strip() for line in text.split("\n") if line.strip() and not line.lstrip().startswith("#")]
    if not questions:
        raise UsageError(f"{path} holds no questions (one per line)")
    return questions


def cross_product(patterns: list[str], questions: list[str]) -> list[JobSpec]:
    """Every document matching the patterns (globs, files or folders, found as ``maskkv ingest`` finds them:
    folders recursively, .pdf/.txt/.md) with every question; each document once, in sorted order per pattern."""
    from maskkv_cli.documents.ingest import discover

    matches: list[str] = []
    for pattern in patterns:
        expanded = str(Path(pattern).expanduser())
        # a path that exists is itself, even with glob characters in its name (report[1].txt); else a glob
        literal = not glob.has_magic(expanded) or Path(expanded).exists()
        found = [expanded] if literal else sorted(glob.glob(expanded, recursive=True))
        if not found:
            raise UsageError(f"--docs {pattern!r} matches no file")
        matches += found
    documents = list(dict.fromkeys(str(p.resolve()) for p in discover(matches).files))
    if not documents:
        raise UsageError("--docs finds no .pdf, .txt or .md file")
    names = [Path(d).name for d in documents]
    shared = {name for name in names if names.count(name) > 1}
    root = os.path.commonpath(documents) if shared else ""

    def label(document: str) -> str:
        """A document's name in its jobs' ids; where two documents share a name, its path under their common
        folder (sub/report.txt, other/report.txt)."""
        name = Path(document).name
        return Path(os.path.relpath(document, root)).as_posix() if name in shared else name

    return [JobSpec(id=f"{label(d)}#q{i}", document=d, question=q)
            for d in documents for i, q in enumerate(questions, 1)]


def job_key(document_sha: str, question: str, model_id: str, dtype: str, device_kind: str,
            settings: AnswerSettings, quantize: str = "none") -> str:
    """A stable hash of everything that decides the answer (24 hex characters); the weights' quantization only
    when there is one, so that unquantized runs keep the keys they had before it existed."""
    payload = {"document": document_sha, "question": question, "model": model_id, "dtype": dtype,
               "device": device_kind, "settings": settings.key_fields()}
    if quantize != "none":
        payload["quantize"] = quantize
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def plan_jobs(specs: list[JobSpec], shas: dict[str, str], settings_for: Callable[[JobSpec], AnswerSettings],
              model_id: str, dtype: str, device_kind: str, quantize: str = "none") -> tuple[list[Job], dict[str, str]]:
    """Resolve each spec's settings (``settings_for``); ``shas`` maps a document path to its content hash ("" when
    unreadable, then the path stands in for it). Returns the jobs, each key once, and the id of each job dropped as
    a duplicate (the same document content, question and settings as an earlier one) with the id answered for it."""
    jobs: list[Job] = []
    seen: dict[str, str] = {}  # key -> the id of the job that runs it
    same_as: dict[str, str] = {}
    for spec in specs:
        settings = settings_for(spec)
        sha = shas.get(spec.document, "")
        key = job_key(sha or f"unreadable:{spec.document}", spec.question, model_id, dtype, device_kind, settings,
                      quantize)
        if key in seen:
            same_as[spec.id] = seen[key]
            continue
        seen[key] = spec.id
        jobs.append(Job(key=key, id=spec.id, document=spec.document, document_sha=sha, question=spec.question,
                        settings=settings))
    return jobs, same_as


def job_settings(spec: JobSpec, base: AnswerSettings, generation: Callable[[int | None], tuple[int, int, int]]
                 ) -> AnswerSettings:
    """The run's settings with the job's overrides; ``generation(gen_length)`` resolves the (gen_length, steps,
    block_length) triple the answer will use, so that the key holds the values and not the defaults."""
    if spec.gen_length is None:
        gen_length, steps, block = generation(base.gen_length)
    else:
        try:
            gen_length, steps, block = generation(spec.gen_length)
        except UsageError as exc:  # the job's own length, named as the jobs file names it
            raise UsageError(f"job {spec.id!r}: {exc}".replace("--gen-length", "its gen_length")) from None
    return replace(base, policy=spec.policy or base.policy,
                   budget=spec.budget if spec.budget is not None else base.budget,
                   ratio=None if spec.budget is not None else base.ratio,
                   gen_length=gen_length, steps=steps, block_length=block)
