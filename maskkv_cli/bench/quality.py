"""``maskkv bench quality``: does eviction keep the answers? Tasks x lengths x policies x budgets.

The tasks come from one of two places:

- generated (``tasks.generate_tasks``) once per (kind, target length) with the model's tokenizer as the length
  measure, hidden in the packaged corpus or in the paragraphs of a user's document (``haystack``);
- read from a JSONL file (LongBench's published format, or our own export, ``maskkv bench tasks``): records are
  grouped by their ``dataset`` (and by target length for exported synthetic tasks) and the first ``samples``
  of each group are used; their lengths are their own.

A synthetic task becomes the prompt the tiny model was trained on (the chat template around
``document_question(context, question)``; a context longer than the window is cut in its middle). A LongBench
task gets the harness's prompt (``longbench.py``: the task's template, the first and last half of the tokens
when too long, the chat template after the cut except for the few-shot and code tasks) and its own answer
length. Then, for every (policy, budget) case, every task is answered greedily and scored with
``metrics.score`` (the metric named by the task's dataset, exact match when unknown). Budgets apply to the
evicting policies only: ``full`` and ``none`` run once, with budget ``None``.

One row per (task, length, policy, budget): ``n``, ``accuracy`` (``metrics.aggregate``: 100 x mean score),
``retention`` (accuracy / the ``full`` accuracy of the same task and length; None when ``full`` is 0 or was
not run), ``ci95`` (the accuracy's 95% interval), ``budget_share`` (budget / mean prompt tokens),
``mean_prompt_tokens`` and timings. Beside the rows, ``paired``: the default policy (``maskkv``, the paper's
method) against every other policy at the same budget, task by task (``bench/paired.py``).

The results folder (``results.ResultsFolder``) holds ``config.json``, ``results.jsonl``, ``predictions.jsonl``
(one line per task and case), ``summary.md`` and ``quality.png``. A row's ``key`` hashes everything that
decides its numbers (task, length, policy, budget, n, seed, the model's identity and dtype, the generation
settings, the task source), so a re-run into the same folder reuses the rows it already has.

No Rich or Typer here: the command layer renders.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from maskkv_cli.bench.metrics import aggregate, is_no_answer, metric_for, score
from maskkv_cli.bench.paired import add_intervals, paired_comparisons, paired_markdown
from maskkv_cli.bench.results import ResultsFolder, atomic_write_bytes, atomic_write_text, read_jsonl, settings_key
from maskkv_cli.bench.tasks import (
    KINDS,
    Task,
    digit_mixing,
    distractor_values,
    generate_tasks,
    load_jsonl,
    split_paragraphs,
)
from maskkv_cli.defaults import DEFAULT_POLICY
from maskkv_cli.errors import UsageError

BENCH_KIND = "quality"
DEFAULT_KINDS: tuple[str, ...] = ("niah_single", "niah_multikey")
DEFAULT_LENGTHS: tuple[int, ...] = (256, 512)
DEFAULT_SAMPLES = 50
DEFAULT_POLICIES: tuple[str, ...] = ("full", "maskkv", "maskkv-plus", "snapkv", "pyramidkv", "adakv", "streamingllm",
                                     "random")
DEFAULT_BUDGETS: tuple[int, ...] = (8, 16, 32, 64)
FALLBACK_GENERATION: dict[str, int] = {"gen_length": 16, "steps": 16, "block_length": 16}
PREDICTIONS_FILE = "predictions.jsonl"
DOCUMENT_QUESTION = "document_question"  # the chat template around document + question (the synthetic tasks)
SUMMARY_FILE = "summary.md"
PLOT_FILE = "quality.png"
TABLE_HEADERS: tuple[str, ...] = ("task", "length", "policy", "budget", "n", "accuracy", "95% interval",
                                  "retention", "share", "prompt", "s/sample")
_FINGERPRINT_BYTES = 1 << 20


# ----- options -------------------------------------------------------------------------------------------------


def parse_policies(text: str) -> tuple[str, ...]:
    """``"full,maskkv"`` -> known policy names, duplicates dropped, order kept."""
    from maskkv_cli.policies.base import policy_names

    known = policy_names()
    names: list[str] = []
    for part in text.split(","):
        name = part.strip()
        if not name:
            continue
        if name not in known:
            raise UsageError(f"unknown policy {name!r} in --policies; choose from: {', '.join(known)}")
        if name not in names:
            names.append(name)
    if not names:
        raise UsageError("--policies is empty; give comma-separated policy names, e.g. full,maskkv")
    return tuple(names)


def is_tasks_file(value: str) -> bool:
    """``--tasks`` names a JSONL file (rather than a comma list of kinds)."""
    return value.strip().lower().endswith(".jsonl") or Path(value).is_file()


def parse_kinds(text: str) -> tuple[str, ...]:
    kinds: list[str] = []
    for part in text.split(","):
        kind = part.strip()
        if not kind:
            continue
        if kind not in KINDS:
            raise UsageError(f"unknown task kind {kind!r} in --tasks; choose from: {', '.join(KINDS)}, or give "
                             "a .jsonl file (LongBench format)")
        if kind not in kinds:
            kinds.append(kind)
    if not kinds:
        raise UsageError(f"--tasks is empty; give task kinds ({', '.join(KINDS)}) or a .jsonl file")
    return tuple(kinds)


@dataclass(frozen=True)
class Case:
    """One (policy, budget) setting; ``budget`` is None for the policies that keep the whole prompt."""

    policy: str
    budget: int | None

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy} B={self.budget}"


def plan_cases(policies: Sequence[str], budgets: Sequence[int]) -> list[Case]:
    """Each non-evicting policy once (budget None), each evicting policy at every budget; order as given."""
    from maskkv_cli.policies.base import get_policy

    cases: list[Case] = []
    for name in policies:
        if get_policy(name).evicts:
            cases.extend(Case(name, budget) for budget in budgets)
        else:
            cases.append(Case(name, None))
    return cases


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

    @property
    def n(self) -> int:
        return len(self.tasks)

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(len(p) for p in self.prompts) / len(self.prompts) if self.prompts else 0.0


@dataclass
class TaskSource:
    """Where the tasks come from, for the settings and the row keys."""

    kind: str  # "corpus", "haystack" or "file"
    name: str  # file name, or "" for the corpus
    digest: str  # sha256 of the file's bytes (or "")

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "digest": self.digest}


def read_haystack(path: str | Path) -> tuple[list[str] | None, TaskSource]:
    """The paragraphs to hide needles in: a named source (``bench/sources.py``: corpus, pydoc-topics,
    stdlib-train, stdlib-heldout, ...) unless a file of that name exists, else a user's document (PDF, text or
    Markdown). ``corpus`` gives None (the default haystack, so its rows are the default run's)."""
    from maskkv_cli.bench.sources import SOURCES, load_source, source_digest
    from maskkv_cli.documents import load_document

    name = str(path)
    if name in SOURCES and not Path(name).exists():
        if name == "corpus":
            return None, TaskSource("corpus", "", "")
        try:
            paragraphs = load_source(name)
        except ValueError as exc:
            raise UsageError(f"--haystack: {exc}") from None
        return paragraphs, TaskSource("source", name, source_digest(paragraphs))
    doc = load_document(path)
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
    """Prompt ids of each task (chat template, document then question); contexts too long are cut in the middle.

    Returns the prompts and how many of them were cut.
    """
    from maskkv_cli.longctx import fit_context
    from maskkv_cli.prompting import document_question

    cfg = session.model.config
    prompts: list[list[int]] = []
    truncated = 0
    for task in tasks:
        room = session.window - session.prompt_overhead(task.input) - gen_length
        fitted = fit_context(session.tokenizer, task.context, room, "truncate", cfg.head_dim, session.base_theta,
                             session.window)
        truncated += fitted.dropped > 0
        prompts.append(session.prompt_ids(document_question(fitted.text, task.input)))
    return prompts, truncated


def build_groups(session: Any, *, kinds: Sequence[str] = DEFAULT_KINDS, lengths: Sequence[int] = DEFAULT_LENGTHS,
                 samples: int = DEFAULT_SAMPLES, seed: int = 0, gen_length: int = 16,
                 haystack: Sequence[str] | None = None,
                 file_groups: Sequence[FileGroup] | None = None,
                 templates: Mapping[str, str] | None = None, task_lengths: bool = True) -> list[TaskGroup]:
    """Generate (or take from a file) the tasks once and encode their prompts once.

    Datasets of a file that are LongBench tasks get the harness's prompts (``longbench.py``; ``templates``
    replaces the built-in wording) and, with ``task_lengths``, their own answer lengths instead of ``gen_length``.
    """
    from maskkv_cli.bench.longbench import encode_longbench, prompt_spec

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
        prompts, cut = encode_tasks(session, tasks, own or gen_length)
        groups.append(TaskGroup(kind, length, tasks, prompts, cut, gen_length=own))
    return groups


def summary_length(session: Any) -> int:
    """Tokens of one lead summary: the model's ``summary_length`` (``generation_config.json``), else
    ``SUMMARY_TOKENS``."""
    from maskkv_cli.summarize import SUMMARY_TOKENS

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


# ----- model identity and keys -----------------------------------------------------------------------------


def _is_model_note(name: str) -> bool:
    """Files in a model folder that describe the model without taking part in running it."""
    lower = name.lower()
    return lower == "training.json" or lower.endswith(".md") or lower.startswith(("license", "notice"))


def model_fingerprint(path: str | Path) -> str:
    """A short hash that changes when the checkpoint changes: every file's name, size, first and last MiB.

    Cheap for an 8B checkpoint and exact for the few-MB tiny model (read whole), and independent of where the
    folder lives, so a copy of the same checkpoint reuses rows. Files that cannot change an answer (the training
    record, read-me and licence files) are left out, so editing a model's notes keeps its finished rows.
    """
    from maskkv_cli.models.loading import resolve_model_path

    folder = resolve_model_path(path)
    digest = hashlib.sha256()
    for item in sorted(folder.iterdir()):
        if item.name.startswith(".") or not item.is_file() or _is_model_note(item.name):
            continue
        size = item.stat().st_size
        digest.update(f"{item.name}\x00{size}\x00".encode())
        with item.open("rb") as handle:
            digest.update(handle.read(_FINGERPRINT_BYTES))
            if size > 2 * _FINGERPRINT_BYTES:
                handle.seek(size - _FINGERPRINT_BYTES)
            digest.update(handle.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]


def group_generation(gen: Any, group: TaskGroup) -> Any:
    """The run's generation settings, or for a group with its own answer length: that length, one token per
    step (the MaskKV paper's LongBench setting) and the run's block length when it divides the length."""
    length = group.gen_length
    if length is None or length == gen.gen_length:
        return gen
    block = gen.block_length if length % gen.block_length == 0 else length
    return replace(gen, gen_length=length, steps=length, block_length=block)


def generation_settings(gen: Any) -> dict[str, Any]:
    return {"gen_length": gen.gen_length, "steps": gen.steps, "block_length": gen.block_length,
            "temperature": gen.temperature, "remasking": gen.remasking, "threshold": gen.threshold}


def row_key(group: TaskGroup, case: Case, *, seed: int, model_id: str, dtype: str, gen: dict[str, Any],
            source: TaskSource) -> str:
    """What decides one row's numbers, hashed (the prompt format only when it is not the default, so rows of
    the synthetic tasks keep their keys)."""
    fmt = {} if group.prompt_format == DOCUMENT_QUESTION else {"prompt": group.prompt_format}
    return settings_key({
        "task": group.task, "length": group.length, "policy": case.policy, "budget": case.budget, "n": group.n,
        "seed": seed, "model": model_id, "dtype": dtype, "gen": gen, "source": source.as_dict(), **fmt,
        **policy_rule(case.policy),
    })


def policy_rule(name: str) -> dict[str, Any]:
    """``Policy.rule()`` of the policy ``name`` (empty for a name that is not a policy)."""
    from maskkv_cli.policies.base import get_policy

    try:
        return get_policy(name).rule()
    except UsageError:
        return {}


# ----- retention, table, summary ---------------------------------------------------------------------------


def add_retention(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the rows with ``retention`` = accuracy / full accuracy of the same (task, length).

    None when there is no ``full`` row for that cell or its accuracy is 0.
    """
    full: dict[tuple[Any, Any], float] = {}
    for row in rows:
        if row.get("policy") == "full":
            full[(row.get("task"), row.get("length"))] = float(row["accuracy"])
    out: list[dict[str, Any]] = []
    for row in rows:
        reference = full.get((row.get("task"), row.get("length")))
        retention = None if not reference else round(float(row["accuracy"]) / reference, 4)
        out.append({**row, "retention": retention})
    return out


def display_order(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows by (task, length) cell in first-seen order, then budget (None first, ascending), then policy order."""
    cells: dict[tuple[Any, Any], int] = {}
    policies: dict[str, int] = {}
    for row in rows:
        cells.setdefault((row["task"], row["length"]), len(cells))
        policies.setdefault(row["policy"], len(policies))

    def order(row: dict[str, Any]) -> tuple[int, int, int, int]:
        budget = row.get("budget")
        return (cells[(row["task"], row["length"])], 0 if budget is None else 1, budget or 0,
                policies[row["policy"]])

    return sorted(rows, key=order)


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def table_cells(row: dict[str, Any]) -> list[str]:
    """One row of the table as text, in the order of ``TABLE_HEADERS``."""
    return [
        str(row["task"]),
        "-" if row.get("length") is None else str(row["length"]),
        str(row["policy"]),
        "-" if row.get("budget") is None else str(row["budget"]),
        str(row["n"]),
        f"{float(row['accuracy']):.1f}",
        "-" if not row.get("ci95") else f"{row['ci95'][0]:.1f}-{row['ci95'][1]:.1f}",
        _fmt(row.get("retention"), ".2f"),
        _fmt(row.get("budget_share"), ".1%"),
        _fmt(row.get("mean_prompt_tokens"), ".0f"),
        _fmt(row.get("seconds_per_sample"), ".2f"),
    ]


def _own_lengths(rows: Sequence[dict[str, Any]], gen: dict[str, Any]) -> str:
    own = sorted({f"{r['task']} {r['gen_length']}" for r in rows if r.get("gen_length") not in (None,
                                                                                               gen.get("gen_length"))})
    return f" (LongBench answer lengths, one token per step: {', '.join(own)})" if own else ""


def summary_markdown(rows: Sequence[dict[str, Any]], settings: dict[str, Any],
                     paired: Sequence[dict[str, Any]] = ()) -> str:
    gen = settings.get("generation", {})
    lines = [
        "# maskkv bench quality",
        "",
        f"- model: `{settings.get('model')}` ({settings.get('model_id')}, {settings.get('dtype')})",
        f"- tasks: {settings.get('source', {}).get('kind')} {settings.get('tasks')}; samples per cell: "
        f"{settings.get('samples')}; seed {settings.get('seed')}",
        f"- generation: {gen.get('gen_length')} tokens, {gen.get('steps')} steps, blocks of "
        f"{gen.get('block_length')}, greedy" + _own_lengths(rows, gen),
        "- accuracy: 100 x mean score (exact match for the synthetic tasks, LongBench metric per dataset); "
        "95% interval: of the accuracy (Wilson for exact match); "
        "retention: accuracy / full-cache accuracy of the same task and length; share: budget / mean prompt "
        "tokens; prompt: mean prompt tokens (chat template included); s/sample: seconds per answer",
        "",
        "| " + " | ".join(TABLE_HEADERS) + " |",
        "|" + "|".join("---" if i in (0, 2) else "---:" for i in range(len(TABLE_HEADERS))) + "|",
    ]
    for row in display_order(rows):
        lines.append("| " + " | ".join(table_cells(row)) + " |")
    sections = [text for text in (paired_markdown(paired), distractor_markdown(rows)) if text]
    return "\n".join(lines) + "\n" + "".join("\n" + text for text in sections)


def distractor_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """For tasks with distractor needles: of the wrong answers, how many were another needle's whole number (the
    wrong key matched, or eviction kept a distractor and lost the answer) and how many were something else
    (digits mixed from several needles, a wrong digit, cut short). Empty when no row counted them."""
    counted = [row for row in display_order(rows) if row.get("distractor_answers") is not None]
    if not counted:
        return ""
    lines = ["## Wrong answers: another needle's number or something else", "",
             "Wrong digits: places where a wrong answer differs from the right number; of them, a distractor's: "
             "the digit a distractor's number has at that place (about one in four by chance with three).", "",
             "| task | length | policy | budget | wrong | another needle's number | something else | wrong digits "
             "| of them a distractor's |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in counted:
        wrong = int(row["n"]) - round(float(row.get("score_sum", 0.0)))
        other = int(row["distractor_answers"])
        budget = "-" if row.get("budget") is None else str(row["budget"])
        digits = [row.get("wrong_digits"), row.get("distractor_digits")]
        lines.append(f"| {row['task']} | {row['length']} | {row['policy']} | {budget} | {wrong} | {other} | "
                     f"{wrong - other} | " + " | ".join("-" if d is None else str(d) for d in digits) + " |")
    return "\n".join(lines) + "\n"


def plot_quality(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    """Accuracy against budget, a line per evicting policy, one subplot per (task, length); full (and none)
    as horizontal lines. False when matplotlib is not installed or no row has a budget."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    cells: list[tuple[Any, Any]] = []
    for row in rows:
        if (row["task"], row["length"]) not in cells:
            cells.append((row["task"], row["length"]))
    if not cells:
        return False
    columns = min(3, len(cells))
    lines = -(-len(cells) // columns)
    figure = Figure(figsize=(5.0 * columns, 3.6 * lines), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(lines, columns, squeeze=False)
    for index, (task, length) in enumerate(cells):
        ax = axes[index // columns][index % columns]
        cell_rows = [r for r in rows if (r["task"], r["length"]) == (task, length)]
        budgets = sorted({r["budget"] for r in cell_rows if r.get("budget") is not None})
        curves: dict[str, list[tuple[int, float]]] = {}
        for r in cell_rows:
            if r.get("budget") is not None:
                curves.setdefault(r["policy"], []).append((r["budget"], float(r["accuracy"])))
        for policy, points in curves.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        for r in cell_rows:
            if r.get("budget") is None:
                ax.axhline(float(r["accuracy"]), linestyle="--", color="black" if r["policy"] == "full" else "gray",
                           label=f"{r['policy']} ({float(r['accuracy']):.1f})")
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
        ax.set_ylim(-2, 102)
        ax.set_xlabel("budget (K/V pairs per head)")
        ax.set_ylabel("accuracy")
        ax.set_title(task if length is None else f"{task}, {length} tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for index in range(len(cells), lines * columns):
        axes[index // columns][index % columns].set_visible(False)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(path, buffer.getvalue())
    return True


# ----- the run -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QualityProgress:
    """After each sample (``finished`` False) and after each (policy, budget) over every cell (``finished``)."""

    case: Case
    index: int  # 1-based number of the case
    cases: int
    done: int  # samples finished (or reused) over the whole run
    total: int
    finished: bool = False
    rows: tuple[dict[str, Any], ...] = ()  # the case's rows, when finished
    reused: bool = False  # every row of the finished case came from an earlier run
    seconds: float = 0.0  # time spent on the finished case


@dataclass
class QualityRun:
    rows: list[dict[str, Any]]
    folder: Path
    settings: dict[str, Any]
    reused: int  # rows taken from an earlier run
    ran: int  # rows computed now
    plot: Path | None
    notes: list[str] = field(default_factory=list)
    paired: list[dict[str, Any]] = field(default_factory=list)  # the default policy against each other policy


@dataclass(frozen=True)
class CellAnswer:
    """One task's answer with its timings (what a worker sends back; scoring happens where the rows are written)."""

    text: str
    seconds: float
    prefill_s: float | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class QualityCell:
    """One row's work, (task, length) x (policy, budget): its prompts, generation and cache settings."""

    key: str
    group: int
    case: int
    prompts: list[list[int]]
    gen: Any
    cache: Any


CellRunner = Callable[[list[QualityCell]], Iterable[tuple[QualityCell, list[CellAnswer]]]]


def answer_prompt(session: Any, ids: list[int], gen: Any, cache: Any) -> CellAnswer:
    """Answer one prompt greedily, timed."""
    t0 = time.perf_counter()
    answer = session.answer_ids(ids, gen, cache)
    seconds = time.perf_counter() - t0
    stats = getattr(getattr(answer, "result", None), "stats", None)
    return CellAnswer(answer.text, seconds, None if stats is None else float(stats.prefill_s),
                      tuple(getattr(answer, "notes", None) or ()))


def _case_row(group: TaskGroup, case: Case, key: str, scores: list[float], seconds: list[float],
              prefill: list[float], settings: dict[str, Any], gen: Any) -> dict[str, Any]:
    mean_prompt = group.mean_prompt_tokens
    dataset = group.tasks[0].dataset if group.tasks else group.task
    return {
        "key": key,
        "task": group.task,
        "length": group.length,
        "policy": case.policy,
        "budget": case.budget,
        "n": group.n,
        "accuracy": aggregate(scores),
        "score_sum": round(sum(scores), 6),
        "retention": None,
        "budget_share": None if case.budget is None or not mean_prompt else round(case.budget / mean_prompt, 4),
        "mean_prompt_tokens": round(mean_prompt, 2),
        "truncated": group.truncated,
        "metric": metric_for(dataset).__name__,
        "seconds": round(sum(seconds), 4),
        "seconds_per_sample": round(sum(seconds) / len(seconds), 4) if seconds else 0.0,
        "prefill_s": round(sum(prefill) / len(prefill), 5) if prefill else None,
        "model": settings["model"],
        "model_id": settings["model_id"],
        "seed": settings["seed"],
        "gen_length": gen.gen_length,
        "steps": gen.steps,
        "block_length": gen.block_length,
    }


def _line_sum(lines: Sequence[dict[str, Any]], field: str) -> int | None:
    """The sum of a per-answer mark or count over a row's prediction lines (True counts 1); None when no line has
    it (no task of the row has distractor needles)."""
    values = [int(line[field]) for line in lines if field in line]
    return sum(values) if values else None


def _prediction_lines(path: Path, keep: set[str]) -> dict[str, list[dict[str, Any]]]:
    kept: dict[str, list[dict[str, Any]]] = {}
    for line in read_jsonl(path):
        if line.get("key") in keep:
            kept.setdefault(line["key"], []).append(line)
    return kept


def run_quality(
    session: Any,
    groups: Sequence[TaskGroup],
    cases: Sequence[Case],
    gen: Any,
    *,
    source: TaskSource,
    tasks_label: str,
    samples: int,
    seed: int = 0,
    out: Path | None = None,
    fresh: bool = False,
    layer_budgets: str = "auto",
    on_progress: Callable[[QualityProgress], None] | None = None,
    cell_runner: CellRunner | None = None,
) -> QualityRun:
    """Run every case over every group, reusing the rows an earlier identical run left in the folder.

    ``out``: the results folder (default: the newest ``runs/bench-quality-*`` with identical settings, else a new
    timestamped one); ``fresh``: a new folder, nothing reused. ``cell_runner``: answer the rows' cells elsewhere
    (worker processes, Ray actors: ``maskkv_cli.batch.cells``) and yield them as they finish; rows and keys are
    the same as in this process.
    """
    from maskkv_cli.policies.base import PolicyOptions
    from maskkv_cli.session import CacheConfig

    if not groups or not cases:
        raise UsageError("nothing to run: no tasks or no policies")
    model_id = model_fingerprint(session.model_path)
    dtype = str(session.model.dtype).removeprefix("torch.")
    gen_settings = generation_settings(gen)
    group_gens = [group_generation(gen, g) for g in groups]
    settings: dict[str, Any] = {
        "tasks": tasks_label,
        "source": source.as_dict(),
        "lengths": sorted({g.length for g in groups if g.length is not None}),
        "samples": samples,
        "seed": seed,
        "policies": list(dict.fromkeys(c.policy for c in cases)),
        "budgets": sorted({c.budget for c in cases if c.budget is not None}),
        "layer_budgets": layer_budgets,
        "generation": gen_settings,
        "model": session.model_path,
        "model_id": model_id,
        "dtype": dtype,
    }
    keys = {(gi, ci): row_key(g, c, seed=seed, model_id=model_id, dtype=dtype,
                              gen={**generation_settings(group_gens[gi]), "layer_budgets": layer_budgets},
                              source=source)
            for ci, c in enumerate(cases) for gi, g in enumerate(groups)}
    planned = [keys[(gi, ci)] for ci in range(len(cases)) for gi in range(len(groups))]
    folder = ResultsFolder.open(BENCH_KIND, settings, planned, out=out, fresh=fresh)
    predictions = _prediction_lines(folder.path / PREDICTIONS_FILE, set(folder.rows))

    def write_predictions() -> None:
        text = "".join(json.dumps(line, ensure_ascii=False, sort_keys=True) + "\n"
                       for key in planned for line in predictions.get(key, []))
        atomic_write_text(folder.path / PREDICTIONS_FILE, text)

    write_predictions()
    notes: list[str] = []
    for group in groups:
        if group.truncated:
            notes.append(f"{group.truncated} of {group.n} {group.task} prompts were longer than the "
                         f"{session.window}-token window and were cut in the middle")
    total = sum(g.n for g in groups) * len(cases)
    done = 0
    ran = 0

    def cache_for(case: Case) -> Any:
        return CacheConfig(policy=case.policy, budget=case.budget, options=PolicyOptions(seed=seed),
                           layer_budgets=layer_budgets)

    def record(gi: int, ci: int, answers: Sequence[CellAnswer]) -> dict[str, Any]:
        """Score a cell's answers, save its predictions, then its row."""
        group, case, key = groups[gi], cases[ci], keys[(gi, ci)]
        scores: list[float] = []
        lines: list[dict[str, Any]] = []
        for task, answer in zip(group.tasks, answers, strict=True):
            for message in answer.notes:
                if message not in notes:
                    notes.append(message)
            value = score(task.dataset, answer.text, task.answers, all_classes=task.meta.get("all_classes"))
            scores.append(value)
            line = {"key": key, "id": task.meta.get("_id"), "task": group.task, "length": group.length,
                    "policy": case.policy, "budget": case.budget, "prediction": answer.text,
                    "gold": list(task.answers), "score": round(value, 6)}
            others = distractor_values(task)
            line["no_answer"] = is_no_answer(answer.text)
            if others:
                line["distractor"] = answer.text.strip() in others
                line["wrong_digits"], line["distractor_digits"] = digit_mixing(answer.text, task.answers[0], others)
            lines.append(line)
        prefill = [a.prefill_s for a in answers if a.prefill_s is not None]
        row = _case_row(group, case, key, scores, [a.seconds for a in answers], prefill, settings, group_gens[gi])
        row["distractor_answers"] = _line_sum(lines, "distractor")
        row["no_answers"] = _line_sum(lines, "no_answer")  # answers that say the fact is not there
        row["wrong_digits"] = _line_sum(lines, "wrong_digits")
        row["distractor_digits"] = _line_sum(lines, "distractor_digits")
        predictions[key] = lines
        write_predictions()  # before the row: a row in results.jsonl always has its predictions
        folder.put(row)
        return row

    def finished(gi: int, ci: int) -> bool:
        key = keys[(gi, ci)]
        return folder.get(key) is not None and key in predictions

    if cell_runner is None:
        for ci, case in enumerate(cases):
            started = time.perf_counter()
            cache = cache_for(case)
            case_rows: list[dict[str, Any]] = []
            all_reused = True
            for gi, group in enumerate(groups):
                if finished(gi, ci):
                    case_rows.append(folder.get(keys[(gi, ci)]))  # type: ignore[arg-type]
                    done += group.n
                    continue
                all_reused = False
                answers: list[CellAnswer] = []
                for ids in group.prompts:
                    answers.append(answer_prompt(session, ids, group_gens[gi], cache))
                    done += 1
                    if on_progress:
                        on_progress(QualityProgress(case, ci + 1, len(cases), done, total))
                case_rows.append(record(gi, ci, answers))
                ran += 1
            if on_progress:
                on_progress(QualityProgress(case, ci + 1, len(cases), done, total, finished=True,
                                            rows=tuple(case_rows), reused=all_reused,
                                            seconds=time.perf_counter() - started))
    else:  # cells answered elsewhere (worker processes, Ray actors), recorded here as they arrive
        started = time.perf_counter()
        pending = [(gi, ci) for ci in range(len(cases)) for gi in range(len(groups)) if not finished(gi, ci)]
        left = {ci: sum(1 for _, c in pending if c == ci) for ci in range(len(cases))}
        done = total - sum(groups[gi].n for gi, _ in pending)
        for ci, case in enumerate(cases):
            if not left[ci] and on_progress:
                rows = tuple(folder.get(keys[(gi, ci)]) for gi in range(len(groups)))
                on_progress(QualityProgress(case, ci + 1, len(cases), done, total, finished=True,
                                            rows=rows, reused=True))  # type: ignore[arg-type]
        cells = [QualityCell(keys[(gi, ci)], gi, ci, groups[gi].prompts, group_gens[gi], cache_for(cases[ci]))
                 for gi, ci in pending]
        for cell, answers in cell_runner(cells):
            record(cell.group, cell.case, answers)
            ran += 1
            done += groups[cell.group].n
            left[cell.case] -= 1
            if on_progress:
                case = cases[cell.case]
                finished_case = left[cell.case] == 0
                rows = tuple(folder.get(keys[(gi, cell.case)]) for gi in range(len(groups))) if finished_case else ()
                on_progress(QualityProgress(case, cell.case + 1, len(cases), done, total, finished=finished_case,
                                            rows=rows, seconds=time.perf_counter() - started))  # type: ignore[arg-type]
    # Per-task scores by position: every case answers a group's tasks in the same order.
    task_scores = {key: {str(i): float(line["score"]) for i, line in enumerate(lines)}
                   for key, lines in predictions.items()}
    rows = add_intervals(add_retention(folder.ordered()), task_scores)
    paired = paired_comparisons(rows, task_scores, DEFAULT_POLICY)
    folder.update(rows)
    folder.write_text(SUMMARY_FILE, summary_markdown(rows, settings, paired))
    plot: Path | None = folder.path / PLOT_FILE
    if not plot_quality(rows, folder.path / PLOT_FILE):
        plot = None
        notes.append("matplotlib is not installed: skipped quality.png (pip install 'maskkv[plot]')")
    return QualityRun(rows=rows, folder=folder.path, settings=settings, reused=len(planned) - ran, ran=ran,
                      plot=plot, notes=notes, paired=paired)
