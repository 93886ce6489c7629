"""``maskkv bench quality``: does eviction keep the answers? Tasks x lengths x policies x budgets.

The tasks come from one of two places:

- generated (``tasks.synthetic.generate_tasks``) once per (kind, target length) with the model's tokenizer as the length
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

The plan (defaults, cases) is in ``quality_plan.py``, the task sources and prompts in ``quality_sources.py``,
retention, summary.md and the plot in ``quality_report.py``; this module keys the rows and runs them. No Rich or
Typer here: the command layer renders.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from maskkv_cli.bench.paired import add_intervals, paired_comparisons
from maskkv_cli.bench.quality_plan import BENCH_KIND, Case
from maskkv_cli.bench.quality_report import add_retention, plot_quality, summary_markdown
from maskkv_cli.bench.quality_sources import DOCUMENT_QUESTION, TaskGroup, TaskSource
from maskkv_cli.bench.results import ResultsFolder, read_jsonl, settings_key
from maskkv_cli.defaults import DEFAULT_POLICY
from maskkv_cli.errors import UsageError
from maskkv_cli.runtime.fileio import atomic_write_text, open_file_mode
from maskkv_cli.tasks.cells import CellAnswer, CellRunner, QualityCell, answer_prompts
from maskkv_cli.tasks.metrics import aggregate, digit_mixing, distractor_values, is_no_answer, metric_for, score

PREDICTIONS_FILE = "predictions.jsonl"
SUMMARY_FILE = "summary.md"
PLOT_FILE = "quality.png"


# ----- model identity and keys -----------------------------------------------------------------------------


def group_generation(gen: Any, group: TaskGroup) -> Any:
    """The run's generation settings, or for a group with its own answer length: that length, one token per
    step (the MaskKV paper's LongBench setting) and the run's block length when it divides the length; a group
    the model was trained to decode in its own blocks (lead summaries, ``summary_block_length``) gets those."""
    from maskkv_cli.app.run_settings import fitted_block

    length = group.gen_length
    if length is None or length == gen.gen_length:
        return gen
    return replace(gen, gen_length=length, steps=length,
                   block_length=fitted_block(length, group.block_length, gen.block_length))


def generation_settings(gen: Any) -> dict[str, Any]:
    return {"gen_length": gen.gen_length, "steps": gen.steps, "block_length": gen.block_length,
            "temperature": gen.temperature, "remasking": gen.remasking, "threshold": gen.threshold}


def row_key(group: TaskGroup, case: Case, *, seed: int, model_id: str, dtype: str, gen: dict[str, Any],
            source: TaskSource, quantize: str = "none") -> str:
    """What decides one row's numbers, hashed (the prompt format only when it is not the default, so rows of
    the synthetic tasks keep their keys; the weights' quantization only when there is one, so unquantized rows
    keep theirs)."""
    fmt = {} if group.prompt_format == DOCUMENT_QUESTION else {"prompt": group.prompt_format}
    weights = {} if quantize == "none" else {"quantize": quantize}
    return settings_key({
        "task": group.task, "length": group.length, "policy": case.policy, "budget": case.budget, "n": group.n,
        "seed": seed, "model": model_id, "dtype": dtype, "gen": gen, "source": source.as_dict(), **fmt, **weights,
        **policy_rule(case.policy),
    })


def policy_rule(name: str) -> dict[str, Any]:
    """``Policy.rule()`` of the policy ``name`` (empty for a name that is not a policy)."""
    from maskkv_cli.policies.base import get_policy

    try:
        return get_policy(name).rule()
    except UsageError:
        return {}


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
        "dtype": settings["dtype"],
        "quantize": settings.get("quantize", "none"),  # rows of runs with other weights can share a folder
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


class _Recorder:
    """What both ways of answering share: the rows' keys, the results folder, the predictions, the notes, and
    ``record`` (score a cell's answers, then save its predictions before its row)."""

    def __init__(self, session: Any, groups: Sequence[TaskGroup], cases: Sequence[Case], gen: Any, *,
                 source: TaskSource, tasks_label: str, samples: int, seed: int, out: Path | None, fresh: bool,
                 layer_budgets: str) -> None:
        self.groups, self.cases, self.seed, self.layer_budgets = groups, cases, seed, layer_budgets
        model_id = session.folder.fingerprint  # hashed once per session's checkpoint
        dtype = str(session.model.dtype).removeprefix("torch.")
        from maskkv_cli.models.quantize import quantization_of

        quantize = quantization_of(session.model)  # a planning session's stands for its workers' models
        self.group_gens = [group_generation(gen, g) for g in groups]
        self.settings: dict[str, Any] = {
            "tasks": tasks_label,
            "source": source.as_dict(),
            "lengths": sorted({g.length for g in groups if g.length is not None}),
            "samples": samples,
            "seed": seed,
            "policies": list(dict.fromkeys(c.policy for c in cases)),
            "budgets": sorted({c.budget for c in cases if c.budget is not None}),
            "layer_budgets": layer_budgets,
            "generation": generation_settings(gen),
            "model": session.model_path,
            "model_id": model_id,
            "dtype": dtype,
            **({} if quantize == "none" else {"quantize": quantize}),
        }
        self.keys = {(gi, ci): row_key(g, c, seed=seed, model_id=model_id, dtype=dtype,
                                       gen={**generation_settings(self.group_gens[gi]), "layer_budgets": layer_budgets},
                                       source=source, quantize=quantize)
                     for ci, c in enumerate(cases) for gi, g in enumerate(groups)}
        self.planned = [self.keys[(gi, ci)] for ci in range(len(cases)) for gi in range(len(groups))]
        self.folder = ResultsFolder.open(BENCH_KIND, self.settings, self.planned, out=out, fresh=fresh)
        self.predictions = _prediction_lines(self.folder.path / PREDICTIONS_FILE,
                                             set(self.folder.rows) | set(self.folder.others))
        self.write_predictions()
        self.notes = [f"{g.truncated} of {g.n} {g.task} prompts were longer than the {session.window}-token window "
                      "and were cut in the middle" for g in groups if g.truncated]
        self.total = sum(g.n for g in groups) * len(cases)

    def cache_for(self, case: Case) -> Any:
        from maskkv_cli.app.run_settings import RunSettings

        return RunSettings(policy=case.policy, budget=case.budget, seed=self.seed,
                           layer_budgets=self.layer_budgets).cache()

    def write_predictions(self) -> None:
        text = "".join(json.dumps(line, ensure_ascii=False, sort_keys=True) + "\n"
                       for key in [*self.planned, *self.folder.others] for line in self.predictions.get(key, []))
        atomic_write_text(self.folder.path / PREDICTIONS_FILE, text, mode=open_file_mode())

    def finished(self, gi: int, ci: int) -> bool:
        key = self.keys[(gi, ci)]
        return self.folder.get(key) is not None and key in self.predictions

    def rows_of(self, ci: int) -> tuple[dict[str, Any], ...]:
        return tuple(self.folder.get(self.keys[(gi, ci)]) for gi in range(len(self.groups)))  # type: ignore[misc]

    def record(self, gi: int, ci: int, answers: Sequence[CellAnswer]) -> dict[str, Any]:
        """Score a cell's answers, save its predictions, then its row."""
        group, case, key = self.groups[gi], self.cases[ci], self.keys[(gi, ci)]
        scores: list[float] = []
        lines: list[dict[str, Any]] = []
        for task, answer in zip(group.tasks, answers, strict=True):
            for message in answer.notes:
                if message not in self.notes:
                    self.notes.append(message)
            value = score(task.dataset, answer.text, task.answers, all_classes=task.meta.get("all_classes"))
            scores.append(value)
            line = {"key": key, "id": task.meta.get("_id"), "task": group.task, "length": group.length,
                    "policy": case.policy, "budget": case.budget, "prediction": answer.text,
                    "gold": list(task.answers), "score": round(value, 6)}
            others = distractor_values(task)
            line["no_answer"] = is_no_answer(answer.text)
            if answer.confidence is not None:  # what the low-confidence flag would say of this answer
                line["confidence"] = {"mean": round(answer.confidence[0], 4), "min": round(answer.confidence[1], 4)}
            if others:
                line["distractor"] = answer.text.strip() in others
                line["wrong_digits"], line["distractor_digits"] = digit_mixing(answer.text, task.answers[0], others)
            lines.append(line)
        prefill = [a.prefill_s for a in answers if a.prefill_s is not None]
        row = _case_row(group, case, key, scores, [a.seconds for a in answers], prefill, self.settings,
                        self.group_gens[gi])
        row["distractor_answers"] = _line_sum(lines, "distractor")
        row["no_answers"] = _line_sum(lines, "no_answer")  # answers that say the fact is not there
        row["wrong_digits"] = _line_sum(lines, "wrong_digits")
        row["distractor_digits"] = _line_sum(lines, "distractor_digits")
        self.predictions[key] = lines
        self.write_predictions()  # before the row: a row in results.jsonl always has its predictions
        self.folder.put(row)
        return row


def _answer_here(session: Any, rec: _Recorder, on_progress: Callable[[QualityProgress], None] | None,
                 batch_size: int | None = 1) -> int:
    """Answer every unfinished cell in this process, case by case (a cell's prompts up to ``batch_size`` together);
    returns the cells run."""
    cases, groups = rec.cases, rec.groups
    done = ran = 0
    for ci, case in enumerate(cases):
        started = time.perf_counter()
        cache = rec.cache_for(case)
        case_rows: list[dict[str, Any]] = []
        all_reused = True
        for gi, group in enumerate(groups):
            if rec.finished(gi, ci):
                case_rows.append(rec.folder.get(rec.keys[(gi, ci)]))  # type: ignore[arg-type]
                done += group.n
                continue
            all_reused = False
            answers: list[CellAnswer] = answer_prompts(session, group.prompts, rec.group_gens[gi], cache,
                                                       batch_size)
            done += group.n
            if on_progress:
                on_progress(QualityProgress(case, ci + 1, len(cases), done, rec.total))
            case_rows.append(rec.record(gi, ci, answers))
            ran += 1
        if on_progress:
            on_progress(QualityProgress(case, ci + 1, len(cases), done, rec.total, finished=True,
                                        rows=tuple(case_rows), reused=all_reused,
                                        seconds=time.perf_counter() - started))
    return ran


def _answer_elsewhere(rec: _Recorder, cell_runner: CellRunner,
                      on_progress: Callable[[QualityProgress], None] | None, batch_size: int | None = 1) -> int:
    """Hand the unfinished cells to ``cell_runner`` (worker processes, Ray actors) and record them as they
    arrive; returns the cells run."""
    cases, groups = rec.cases, rec.groups
    started = time.perf_counter()
    pending = [(gi, ci) for ci in range(len(cases)) for gi in range(len(groups)) if not rec.finished(gi, ci)]
    left = {ci: sum(1 for _, c in pending if c == ci) for ci in range(len(cases))}
    done = rec.total - sum(groups[gi].n for gi, _ in pending)
    ran = 0
    for ci, case in enumerate(cases):
        if not left[ci] and on_progress:
            on_progress(QualityProgress(case, ci + 1, len(cases), done, rec.total, finished=True,
                                        rows=rec.rows_of(ci), reused=True))
    cells = [QualityCell(rec.keys[(gi, ci)], gi, ci, groups[gi].prompts, rec.group_gens[gi], rec.cache_for(cases[ci]),
                         batch_size)
             for gi, ci in pending]
    for cell, answers in cell_runner(cells):
        rec.record(cell.group, cell.case, answers)
        ran += 1
        done += groups[cell.group].n
        left[cell.case] -= 1
        if on_progress:
            finished_case = left[cell.case] == 0
            on_progress(QualityProgress(cases[cell.case], cell.case + 1, len(cases), done, rec.total,
                                        finished=finished_case, rows=rec.rows_of(cell.case) if finished_case else (),
                                        seconds=time.perf_counter() - started))
    return ran


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
    batch_size: int | None = 1,
) -> QualityRun:
    """Run every case over every group, reusing the rows an earlier identical run left in the folder.

    ``out``: the results folder (default: the newest ``runs/bench-quality-*`` with identical settings, else a new
    timestamped one); ``fresh``: a new folder, nothing reused. ``cell_runner``: answer the rows' cells elsewhere
    (worker processes, Ray actors: ``maskkv_cli.batch.cells``) and yield them as they finish; rows and keys are
    the same as in this process. ``batch_size``: a cell's prompts denoised together, this many at a time (None:
    as many as fit by the memory model); answers do not depend on it, only the times do.
    """
    if not groups or not cases:
        raise UsageError("nothing to run: no tasks or no policies")
    rec = _Recorder(session, groups, cases, gen, source=source, tasks_label=tasks_label, samples=samples, seed=seed,
                    out=out, fresh=fresh, layer_budgets=layer_budgets)
    ran = (_answer_here(session, rec, on_progress, batch_size) if cell_runner is None
           else _answer_elsewhere(rec, cell_runner, on_progress, batch_size))
    # Per-task scores by position: every case answers a group's tasks in the same order.
    task_scores = {key: {str(i): float(line["score"]) for i, line in enumerate(lines)}
                   for key, lines in rec.predictions.items()}
    folder = rec.folder
    rows = add_intervals(add_retention(folder.ordered()), task_scores)
    paired = paired_comparisons(rows, task_scores, DEFAULT_POLICY)
    folder.update(rows)
    folder.write_text(SUMMARY_FILE, summary_markdown(rows, rec.settings, paired))
    plot: Path | None = folder.path / PLOT_FILE
    notes = rec.notes
    if not plot_quality(rows, folder.path / PLOT_FILE):
        plot = None
        notes.append("matplotlib is not installed: skipped quality.png (pip install 'maskkv[plot]')")
    return QualityRun(rows=rows, folder=folder.path, settings=rec.settings, reused=len(rec.planned) - ran, ran=ran,
                      plot=plot, notes=notes, paired=paired)
